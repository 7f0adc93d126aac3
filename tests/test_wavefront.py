"""Reading a text a wavefront at a time (h2o_mini/wavefront.py: the stream loops of chunk c at layer l, chunk c-1
at layer l+1, ... as one batch) against reading its chunks one after another, which test_eviction_parity checks
against the naive reference: the same logits and the same caches afterwards, for every family (sliding and
global layers side by side in one loop), left-padded rows, a last chunk shorter than the others, a rule that
reads attention and one that does not, and rows of several policies."""
import pytest
import torch

from h2o_mini import wavefront
from h2o_mini.generate import Decoder, left_pad
from h2o_mini.policies import make_policy
from h2o_mini.policies.rows import Rows

from .conftest import FAMILIES, text_bytes

T = 45


def _policies():
    return {"h2o": make_policy("h2o", 9, T), "knorm": make_policy("knorm", 7, T),
            "rows": Rows([(make_policy("h2o", 9, T), 1), (make_policy("tova", 12, T), 1)])}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["h2o", "knorm", "rows"])
def test_a_wavefront_read_equals_the_chunks_in_turn(tiny_model, family, name):
    """1e-5: the loops' arithmetic is each row's own, so only the batched matmuls' rounding could differ; a
    different eviction moves the logits by > 1e-2."""
    model, policy = tiny_model(family), _policies()[name]
    idx, pos = left_pad([text_bytes(T, offset=100), text_bytes(31, offset=900)])
    decoder = Decoder(model, chunk=7)  # 7 chunks, the last of 3 tokens
    alone, together = decoder.new_cache(policy, 2, T, "stream"), decoder.new_cache(policy, 2, T, "stream")
    with torch.inference_mode():
        want = torch.cat([model(idx[:, s:s + 7], pos[:, s:s + 7], alone) for s in range(0, T, 7)], 1)
        starts, got = zip(*wavefront.read(model, together, idx, pos, 7))
    assert list(starts) == list(range(0, T, 7))
    real = pos >= 0  # padding's outputs are never read
    assert (torch.cat(got, 1) - want)[real].abs().max() <= 1e-5
    for a, b in zip(alone.layers, together.layers):
        assert torch.equal(a.pos, b.pos) and (a.score - b.score).abs().max() <= 1e-5
        assert b.rendezvous is None  # the caches are left as they were made


def test_a_fault_in_a_pass_reaches_the_reader_and_stops_every_pass(tiny_model):
    """An error inside one chunk's pass (here the model's own forward) is raised by the reader, once, and no
    pass is left waiting for its turn."""
    import threading
    model = tiny_model("llama_gqa_tied")
    idx, pos = left_pad([text_bytes(T)])
    cache = Decoder(model, chunk=7).new_cache(make_policy("h2o", 9, T), 1, T, "stream")
    before = threading.active_count()

    def broken(i, p, c):
        if int(p.max()) >= 20:
            raise RuntimeError("chunk 3 broke")
        return model(i, p, c)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="chunk 3 broke"):
        list(wavefront.read(broken, cache, idx, pos, 7))
    for _ in range(100):  # the passes unwind on their own
        if threading.active_count() <= before:
            break
        threading.Event().wait(0.01)
    assert threading.active_count() <= before

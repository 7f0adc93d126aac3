"""Reading a text a wavefront at a time (h2o_mini/wavefront.py: the stream loops of chunk c at layer l, chunk c-1
at layer l+1, ... as one batch, between the blocks' two stages) against reading its chunks one after another, which test_eviction_parity checks
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


def test_the_read_is_one_loop_in_this_thread(tiny_model):
    """No thread is started while reading (the schedule is a loop over anti-diagonals)."""
    import threading
    model = tiny_model("llama_gqa_tied")
    idx, pos = left_pad([text_bytes(T)])
    cache = Decoder(model, chunk=7).new_cache(make_policy("h2o", 9, T), 1, T, "stream")
    before = threading.active_count()
    with torch.inference_mode():
        for _ in wavefront.read(model, cache, idx, pos, 7):
            assert threading.active_count() == before


def test_a_diagonal_past_the_memory_budget_runs_as_several_batches_with_the_same_logits(tiny_model, monkeypatch):
    """With a loop budget of one cell's transients (the tiny models' diagonals hold two: two layers), no stream
    loop runs more than one cell, and the logits and caches are those of the unbounded read (1e-5, as above)."""
    cells = 1
    from h2o_mini import prompt
    model, policy = tiny_model("llama_gqa_tied"), _policies()["h2o"]
    idx, pos = left_pad([text_bytes(T, offset=100), text_bytes(31, offset=900)])
    decoder = Decoder(model, chunk=7)
    wide, narrow = decoder.new_cache(policy, 2, T, "stream"), decoder.new_cache(policy, 2, T, "stream")
    cfg = model.cfg
    one = wavefront.loop_bytes((2, cfg.n_head, 7, cfg.head_dim), wide.layers[0].capacity)
    widths, stream_many = {"wide": [], "narrow": []}, prompt.stream_many
    with torch.inference_mode():
        monkeypatch.setattr(prompt, "stream_many", lambda r: widths["wide"].append(len(r)) or stream_many(r))
        want = torch.cat([o for _, o in wavefront.read(model, wide, idx, pos, 7)], 1)
        monkeypatch.setattr(wavefront, "loop_budget", lambda device: cells * one)
        monkeypatch.setattr(prompt, "stream_many", lambda r: widths["narrow"].append(len(r)) or stream_many(r))
        got = torch.cat([o for _, o in wavefront.read(model, narrow, idx, pos, 7)], 1)
    # the same cells, in batches of at most `cells` where the unbounded read had wider ones
    assert sum(widths["narrow"]) == sum(widths["wide"]) and max(widths["narrow"]) == cells < max(widths["wide"])
    assert (got - want)[pos >= 0].abs().max() <= 1e-5
    for a, b in zip(wide.layers, narrow.layers):
        assert torch.equal(a.pos, b.pos) and (a.score - b.score).abs().max() <= 1e-5

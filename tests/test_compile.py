"""The compiled decode step (torch.compile, fullgraph=True, static shapes) gives the same tokens as eager, for
every registered policy (one graph per block, as on CPU) and, for two, the whole step as one graph."""
import pytest
import torch

from h2o_mini.generate import Decoder
from h2o_mini.policies import REGISTRY, make_policy

from .conftest import text_bytes


CASES = [("h2o", "step", None), ("local", "step", None)] + [(name, "layer", None) for name in REGISTRY] + [
    ("h2o", "layer", 8), ("scissorhands", "layer", 4)]


@pytest.mark.parametrize("name,how,kv_bits", CASES)
def test_compiled_decode_equals_eager(tiny_model, name, how, kv_bits):
    model = tiny_model("llama_gqa_tied")
    prompts = [text_bytes(20, 0), text_bytes(13, 300)]
    policy = make_policy(name, None if name == "full" else 8, 40)
    eager = Decoder(model, compile=False, kv_bits=kv_bits)
    compiled = Decoder(model, compile=how, kv_bits=kv_bits)
    want = torch.stack(list(eager.generate(prompts, policy, 20, "stream")))
    got = torch.stack(list(compiled.generate(prompts, policy, 20, "stream")))
    assert torch.equal(got, want)
    assert compiled.step is not eager.step  # really the compiled function

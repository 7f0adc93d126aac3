"""The compiled decode step (torch.compile, fullgraph=True, static shapes) gives the same tokens as eager."""
import pytest
import torch

from h2o_mini.generate import Decoder
from h2o_mini.policies import make_policy

from .conftest import text_bytes


@pytest.mark.parametrize("name,how", [("h2o", "step"), ("local", "step"), ("h2o", "layer")])
def test_compiled_decode_equals_eager(tiny_model, name, how):
    model = tiny_model("llama_gqa_tied")
    prompts = [text_bytes(20, 0), text_bytes(13, 300)]
    policy = make_policy(name, 8, 40)
    eager = Decoder(model, compile=False)
    compiled = Decoder(model, compile=how)
    want = torch.stack(list(eager.generate(prompts, policy, 20, "stream")))
    got = torch.stack(list(compiled.generate(prompts, policy, 20, "stream")))
    assert torch.equal(got, want)
    assert compiled.step is not eager.step  # really the compiled function

"""Every policy inside transformers (`h2o_mini/transformers_cache.py`): transformers' own model with the evicting
cache gives h2o-mini's decoder's logits on every family, in decode and both prompt paths, and the same greedy
tokens through `model.generate` with left padding; a family h2o-mini's decoder lacks equals the naive reference
run through that model's own attention; a model the cache cannot hold is refused in one line."""
import json

import pytest
import torch

from h2o_mini import UserError
from h2o_mini.cache import KVCache
from h2o_mini.generate import Decoder, left_pad
from h2o_mini.policies import REGISTRY, make_policy
from h2o_mini.transformers_cache import evicting_cache

from .conftest import FAMILIES, GPL3, add_byte_tokenizer, build_hf, text_bytes
from .test_bad_input import run_cli
from .test_plugins import VNORM

T, C, N = 40, 10, 28
IDS = text_bytes(T, offset=2000)
STEPS = [(t, t + 1) for t in range(N, T)]  # decode steps, each evicting, after a prompt of N tokens read ...
PLANS = {"stream": [(s, s + 7) for s in range(0, N, 7)] + STEPS, "dense": [(0, N)] + STEPS}  # ... either way
DECODE = [(t, t + 1) for t in range(T)]  # every token a decode step


def _policy(name):
    return make_policy(name, None if name == "full" else C, T)


def _ours(model, policy, plan, prefill):
    cache = KVCache(model.cfg, policy, 1, T, prefill=prefill)
    x = torch.tensor([IDS])
    return torch.cat([model(x[:, s:e], torch.arange(s, e)[None], cache) for s, e in plan], 1)[0]


@torch.no_grad()
def _inside(hf, policy, plan, prefill, naive=False):
    cache = evicting_cache(hf, policy, length=T, prefill=prefill, naive=naive)
    x = torch.tensor([IDS])
    return torch.cat([hf(input_ids=x[:, s:e], cache=cache, use_cache=True).logits for s, e in plan], 1)[0], cache


def _diff(a, b):
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = build_hf(name, tmp_path_factory.mktemp(name))
        return built[name]
    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_policy_inside_transformers_equals_h2o_minis_decoder(tiny, tiny_model, family, name):
    """A prompt read by the stream path or the dense one, then decode steps; each step evicts."""
    hf, model, policy = tiny(family)[1], tiny_model(family), _policy(name)
    for prefill, plan in PLANS.items():
        got, cache = _inside(hf, policy, plan, prefill)
        assert _diff(got, _ours(model, policy, plan, prefill)) <= 1e-4, prefill
    # real memory: each layer's tensors hold its C slots per (row, KV head), exactly what h2o-mini's cache holds
    meta = KVCache(model.cfg, policy, 1, T, device="meta")
    assert cache.nbytes == meta.nbytes and cache.inner.capacity == min(policy.capacity or T, T)
    assert [layer.k[0].shape for layer in cache.inner.layers] == [layer.k[0].shape for layer in meta.layers]


@pytest.mark.parametrize("family,name", [("llama_gqa_tied", "h2o"), ("llama_gqa_tied", "tova"),
                                         ("gemma3_hybrid", "h2o"), ("opt_pre_ln_proj", "snapkv")])
@pytest.mark.parametrize("prefill", ["dense", "stream"])
def test_generate_with_left_padding_gives_h2o_minis_tokens(tiny, tiny_model, family, name, prefill):
    """transformers' `generate` pads on the left as h2o-mini does: each row evicts on its own, same greedy tokens."""
    hf, model = tiny(family)[1], tiny_model(family)
    prompts = [text_bytes(30, 0), text_bytes(17, 400), text_bytes(25, 800)]
    policy = make_policy(name, C, 30 + 12)
    want = torch.stack(list(Decoder(model).generate(prompts, policy, 12, prefill)), 1)
    idx, pos = left_pad(prompts, pad_id=0)
    cache = evicting_cache(hf, policy, length=30 + 12, prefill=prefill)
    with torch.no_grad():
        out = hf.generate(idx, attention_mask=(pos >= 0).long(), cache=cache, max_new_tokens=12, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    assert out[:, idx.shape[1]:].tolist() == want.tolist()


@pytest.mark.parametrize("family", ["olmo2", "starcoder2_window"])
@pytest.mark.parametrize("name", ["h2o", "tova", "local"])
def test_a_family_h2o_mini_lacks_runs_exactly_inside_transformers(outside, family, name):
    """The fast cache against the naive reference (`checks/naive.py`), both through the model's own attention."""
    hf, policy = outside(family), _policy(name)
    want = _inside(hf, policy, DECODE, "stream", naive=True)[0]  # one token at a time
    for plan in (DECODE, PLANS["stream"]):
        assert _diff(_inside(hf, policy, plan, "stream")[0], want) <= 1e-4
    got, _ = _inside(hf, policy, PLANS["dense"], "dense")
    assert _diff(got, _inside(hf, policy, PLANS["dense"], "dense", naive=True)[0]) <= 1e-4
    # eviction changes these logits (else the comparison above would prove nothing) ...
    full, _ = _inside(hf, make_policy("full", None, T), DECODE, "stream")
    assert _diff(full, want) > 1e-2
    # ... and with nothing evicted, the cache gives transformers' own attention's logits
    hf.set_attn_implementation("sdpa")
    with torch.no_grad():
        own = hf(torch.tensor([IDS])).logits[0]
    assert _diff(full, own) <= 1e-4


@pytest.mark.parametrize("family,needle", [("bloom", "computes attention in its own code")])
def test_a_model_the_cache_cannot_hold_is_refused_in_one_line(outside, family, needle):
    with pytest.raises(UserError, match=needle):
        evicting_cache(outside(family), "h2o", budget=8)


def test_what_the_cache_cannot_do_is_refused(tiny, outside):
    hf = tiny("llama_gqa_tied")[1]
    with pytest.raises(UserError, match="is a fraction of the sequence: give length="):
        evicting_cache(hf, "h2o", budget=0.2)
    with pytest.raises(UserError, match="keeps every token: give length="):
        evicting_cache(hf, "full")
    with pytest.raises(UserError, match="reads the text ahead"):
        evicting_cache(hf, "hindsight", budget=8)
    with pytest.raises(UserError, match="reads the rotary embedding only of its own families"):
        evicting_cache(outside("olmo2"), "expected_attention", budget=8)
    x = torch.tensor([IDS[:12]])
    with torch.no_grad(), pytest.raises(UserError, match="not beam search"):
        hf.generate(x, cache=evicting_cache(hf, "h2o", budget=8), max_new_tokens=4, num_beams=2, pad_token_id=0)
    hf.set_attn_implementation("h2o_mini")
    with torch.no_grad(), pytest.raises(UserError, match="attends only through an evicting cache"):
        hf(x, use_cache=False)
    cache = evicting_cache(hf, "h2o", budget=8)
    hf.set_attn_implementation("sdpa")  # transformers' own attention would read only each call's new keys
    with torch.no_grad(), pytest.raises(UserError, match="layer 0 attended without the evicting cache"):
        for t in range(2):
            hf(x[:, t:t + 1], cache=cache, use_cache=True)
    hf.set_attn_implementation("eager")


@pytest.fixture(scope="module")
def vnorm(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "vnorm.py"
    path.write_text(VNORM)
    return f"{path}:VNorm"


@pytest.mark.parametrize("policy", ["h2o", "tova", "plugin"])
def test_eval_ppl_gives_the_same_nll_with_either_engine(capsys, monkeypatch, llama_bytes, vnorm, policy):
    spec = vnorm if policy == "plugin" else policy
    results = []
    for engine in ("h2o-mini", "transformers"):
        code, out, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", llama_bytes, "--text", GPL3,
                                 "--tokens", 96, "--policy", spec, "--budget", 16, "--engine", engine, "--json")
        assert code == 0, err
        results.append(json.loads(out))
    ours, theirs = results
    assert abs(ours["nll"] - theirs["nll"]) <= 1e-5 and ours["kv_bytes"] == theirs["kv_bytes"]
    assert ours["capacity"] == theirs["capacity"] == 16


def test_generate_gives_the_same_text_with_either_engine(capsys, monkeypatch, llama_bytes):
    texts = []
    for engine in ("h2o-mini", "transformers"):
        code, out, err = run_cli(capsys, monkeypatch, "generate", "--model", llama_bytes, "--policy", "h2o",
                                 "--budget", 12, "--prefill", "stream", "--max-new-tokens", 24, "--temperature", 1,
                                 "--seed", 3, "--engine", engine, "The licenses for most software")
        assert code == 0, err
        texts.append(out)
    assert texts[0] == texts[1] and len(texts[0]) > 10


def test_a_model_transformers_cannot_run_here_is_one_line(capsys, monkeypatch, outside, tmp_path):
    outside("bloom").save_pretrained(tmp_path, safe_serialization=True)
    add_byte_tokenizer(tmp_path)
    capsys.readouterr()  # (transformers' own progress bars while saving)
    code, _, err = run_cli(capsys, monkeypatch, "generate", "--model", tmp_path, "--engine", "transformers", "hi")
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "computes attention in its own code" in err, err

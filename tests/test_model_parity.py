"""The decoder against transformers on tiny random checkpoints of every supported family variant."""
import pytest
import torch

from h2o_mini.generate import Decoder, left_pad
from h2o_mini.policies import Full

from .conftest import FAMILIES, TINY, seeded_weights_, text_bytes


@pytest.mark.parametrize("name", list(TINY))
def test_logits_match_transformers(tiny, tiny_model, name):
    folder, hf = tiny(name)
    ids = torch.tensor([text_bytes(96, offset=1000)])
    with torch.no_grad():
        want = hf(ids).logits
    got = tiny_model(name)(ids, torch.arange(96)[None])
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["llama_gqa_tied", "opt_pre_ln_proj", "neox_sequential"])
def test_a_prompt_through_the_mlp_a_block_of_tokens_at_a_time_equals_transformers(tiny, tiny_model, monkeypatch,
                                                                                  name):
    """A long prompt takes the MLP in blocks of tokens (`MLP_BLOCK` hidden values); here 7 tokens a block,
    so a 2 x 40 batch is 12 blocks, some across the rows' boundary."""
    import h2o_mini.model
    _, hf = tiny(name)
    model = tiny_model(name)
    monkeypatch.setattr(h2o_mini.model, "MLP_BLOCK", 7 * model.layers[0].mlp.w_up.out_features)
    ids = torch.tensor([text_bytes(40, 0), text_bytes(40, 700)])
    got = model(ids, torch.arange(40).expand(2, 40))
    with torch.no_grad():
        want = hf(ids).logits
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["llama_gqa_tied", "opt_pre_ln_proj", "neox_sequential"])
def test_left_padded_batch_matches_transformers(tiny, tiny_model, name):
    """Padding (negative positions) is never attended: each row equals transformers on that row alone."""
    _, hf = tiny(name)
    prompts = [text_bytes(40, 0), text_bytes(25, 500), text_bytes(33, 900)]
    idx, pos = left_pad(prompts)
    got = tiny_model(name)(idx, pos)
    for row, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        assert (got[row, -len(p):] - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_greedy_equals_recomputing_the_prefix(tiny_model, name):
    model = tiny_model(name)
    prompt = text_bytes(20, 3000)
    got = torch.stack(list(Decoder(model).generate([prompt], Full(), max_new_tokens=16)))[:, 0].tolist()
    ids = list(prompt)
    for _ in range(16):  # no cache at all: the whole prefix every step
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])
        ids.append(int(logits[0, -1].argmax()))
    assert got == ids[len(prompt):]


def test_dtypes_run_and_stay_close(tiny):
    from h2o_mini.weights.hf import load_hf
    folder, _ = tiny("llama_gqa_tied")
    ids = torch.tensor([text_bytes(32)])
    ref = load_hf(folder)(ids, torch.arange(32)[None])
    for dtype in (torch.bfloat16, torch.float16):
        got = load_hf(folder, dtype=dtype)(ids, torch.arange(32)[None])
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert (got - ref).abs().max().item() < 0.25  # half precision, same function


def test_sharded_checkpoint_loads(tiny, tmp_path):
    """model.safetensors.index.json with several shards loads to the same logits."""
    from h2o_mini.weights.hf import load_hf
    _, hf = tiny("neox_sequential")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = torch.tensor([text_bytes(40)])
    with torch.no_grad():
        want = hf(ids).logits
    assert (load_hf(tmp_path)(ids, torch.arange(40)[None]) - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name,edit,needle", [
    ("mistral_no_window", {"sliding_window": 0}, "'sliding_window' is 0, expected a positive window"),
    ("qwen2_hybrid", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "'layer_types' must list sliding_attention or full_attention"),
    ("phi3_partial_rotary", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "unsupported rope type 'longrope'"),
    ("qwen3_qknorm", {"model_type": "gemma9"}, "supported: llama, opt, gpt_neox, qwen2, qwen3, mistral, phi3, gemma2, gemma3_text, gemma3"),
])
def test_what_a_family_does_not_implement_is_refused_by_name(tiny, tmp_path, name, edit, needle):
    import json
    import shutil
    from h2o_mini.config_readers import read_config
    from h2o_mini.errors import UserError
    folder = tmp_path / name
    shutil.copytree(tiny(name)[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(UserError, match=None) as e:
        read_config(folder)
    assert needle in str(e.value)


@pytest.mark.parametrize("name,edit,windows", [
    ("mistral_window", {}, (5, 5)),
    ("qwen2_hybrid", {}, (5, 5, None)),
    ("qwen2_hybrid", {"layer_types": None, "max_window_layers": 1}, (None, 5, 5)),  # the older keys
    ("qwen2_hybrid", {"use_sliding_window": False}, ()),
])
def test_sliding_windows_are_read_from_either_config_style(tiny, tmp_path, name, edit, windows):
    import json
    import shutil
    from h2o_mini.config_readers import read_config
    folder = tmp_path / name
    shutil.copytree(tiny(name)[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in {**config, **edit}.items() if v is not None}))
    assert read_config(folder).windows == windows


def test_a_window_as_long_as_the_positions_is_no_window(tiny, tmp_path):
    """Phi-4-mini's sliding_window (262144) outlasts its positions: read as no window, not refused."""
    import json
    import shutil
    from h2o_mini.config_readers import read_config
    folder = tmp_path / "phi"
    shutil.copytree(tiny("phi3_partial_rotary")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 512}))
    assert read_config(folder).family == "phi3"


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_hybrid", "gemma2_softcap", "gemma3_hybrid"])
@pytest.mark.parametrize("prefill", ["stream", "dense"])
def test_full_on_a_sliding_window_model_holds_w_slots_and_equals_transformers(tiny, tiny_model, name, prefill):
    """`full` keeps min(C, W) = W slots on a sliding layer, really, and still gives transformers' logits: a
    prompt of 30 tokens, then 10 decode steps, windows of 5."""
    from h2o_mini.cache import KVCache
    _, hf = tiny(name)
    model = tiny_model(name)
    ids = text_bytes(40, 2500)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    cache = KVCache(model.cfg, Full(), 1, 40, prefill=prefill)
    assert [layer.capacity for layer in cache.layers] == [w or 40 for w in model.cfg.windows]
    x = torch.tensor([ids])
    got = [model(x[:, :30], torch.arange(30)[None], cache)[0]]
    got += [model(x[:, t:t + 1], torch.tensor([[t]]), cache)[0] for t in range(30, 40)]
    assert (torch.cat(got) - want).abs().max().item() <= 1e-4


def test_tiny_models_do_not_depend_on_transformers_initialisation():
    """The weights come from our seeded generator: whatever transformers draws first is overwritten."""
    from transformers import AutoModelForCausalLM
    states = []
    for torch_seed in (1, 2):
        torch.manual_seed(torch_seed)  # a different draw inside transformers' own init
        model = AutoModelForCausalLM.from_config(TINY["llama_gqa_tied"]())
        seeded_weights_(model, 7)
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])

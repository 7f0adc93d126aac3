"""Gemma 2 / Gemma 3 beyond the logits test of test_model_parity.py: both config styles real checkpoints carry,
the image-text Gemma 3 checkpoint's decoder, and what is refused by name."""
import json
import shutil

import pytest
import torch

from h2o_mini.config_readers import read_config
from h2o_mini.errors import UserError

from .conftest import seeded_weights_, text_bytes, TINY


def _edited(tiny, tmp_path, name, edit, drop=()):
    folder = tmp_path / name
    shutil.copytree(tiny(name)[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in {**config, **edit}.items() if k not in drop}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gemma3_older_config_keys_read_as_transformers_5s(tiny, tmp_path):
    """The keys of checkpoints saved before transformers 5 (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern) give the same Config as layer_types and the per-layer-type rope_parameters."""
    new = read_config(tiny("gemma3_hybrid")[0])
    old = read_config(_edited(tiny, tmp_path, "gemma3_hybrid", {
        "sliding_window_pattern": 3, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, drop=("layer_types", "rope_parameters")))
    assert old == new
    assert new.windows == (5, 5, None) and (new.rope_theta, new.rope_theta_local, new.rope_linear) == (1e6, 1e4, 8.0)
    assert (new.attn_scale, new.norm, new.sandwich_norm, new.embed_scale) == (24 ** -0.5, "rms_1p", True, True)


def test_gemma2_alternates_sliding_and_global_layers_by_default(tiny, tmp_path):
    cfg = read_config(_edited(tiny, tmp_path, "gemma2_softcap", {"num_hidden_layers": 4}, drop=("layer_types",)))
    assert cfg.windows == (5, None, 5, None) and (cfg.attn_softcap, cfg.logit_softcap) == (2.0, 5.0)
    # absent caps are transformers' defaults (50 / 30); null ones are no cap
    cfg = read_config(_edited(tiny, tmp_path / "b", "gemma2_softcap", {}, drop=("attn_logit_softcapping",
                                                                                   "final_logit_softcapping")))
    assert (cfg.attn_softcap, cfg.logit_softcap) == (50.0, 30.0)
    cfg = read_config(_edited(tiny, tmp_path / "c", "gemma2_softcap", {"attn_logit_softcapping": None}))
    assert cfg.attn_softcap is None


def test_gemma2_rope_scaling_applies_to_every_layer(tiny, tmp_path):
    """Gemma 2 has one RoPE for sliding and global layers: a linear scaling is read for all, not refused."""
    cfg = read_config(_edited(tiny, tmp_path, "gemma2_softcap", {"rope_parameters": {
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}))
    assert cfg.rope_linear == 4.0 and cfg.rope_theta_local is None


def test_image_text_gemma3_checkpoint_loads_its_text_decoder(tmp_path):
    """Gemma3ForConditionalGeneration: config under text_config, tensors under language_model, a vision tower
    that h2o-mini skips; on text, its logits are the decoder's."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
    from h2o_mini.weights.hf import load_hf
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=TINY["gemma3_hybrid"]().to_dict(), vision_config=vision.to_dict(),
                       mm_tokens_per_image=4, image_token_index=255, boi_token_index=254, eoi_token_index=253)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    seeded_weights_(hf, 3)
    hf.save_pretrained(tmp_path)
    ids = torch.tensor([[b for b in text_bytes(48, 300) if b < 253][:40]])  # text tokens only
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = load_hf(tmp_path)(ids, torch.arange(ids.shape[1])[None])
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name,edit,needle", [
    ("gemma3_hybrid", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0, which Gemma 3 does not apply"),
    ("gemma3_hybrid", {"use_bidirectional_attention": True}, "use_bidirectional_attention is set"),
    ("gemma3_hybrid", {"rope_parameters": {"sliding_attention": {"rope_type": "dynamic", "factor": 2.0},
                                           "full_attention": {"rope_type": "default"}}}, "unsupported rope type 'dynamic'"),
    ("gemma3_hybrid", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                           "full_attention": {"rope_type": "default"}}}, "a rope scaling on Gemma 3's sliding"),
    ("gemma2_softcap", {"hidden_activation": "gelu_erf_new"}, "unsupported activation 'gelu_erf_new'"),
])
def test_what_gemma_does_not_implement_is_refused_by_name(tiny, tmp_path, name, edit, needle):
    with pytest.raises(UserError) as e:
        read_config(_edited(tiny, tmp_path, name, edit))
    assert needle in str(e.value)


@pytest.mark.parametrize("missing,named", [("model.layers.1.pre_feedforward_layernorm.weight", "layers.1.norm2.weight"),
                                           ("model.layers.0.self_attn.k_norm.weight", "layers.0.attn.k_norm.weight")])
def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path, missing, named):
    from safetensors.torch import load_file, save_file
    from h2o_mini.weights.hf import load_hf
    folder = tmp_path / "g"
    shutil.copytree(tiny("gemma3_hybrid")[0], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors[missing]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(UserError) as e:
        load_hf(folder)
    assert f"the checkpoint lacks the tensor {missing} " in str(e.value)  # by its own name,
    assert f"the model's {named})" in str(e.value)  # and the model's

"""Load a Hugging Face checkpoint folder (config.json + safetensors) into `model.Transformer`.

Only safetensors are read, never pickles. The name map is strict: each checkpoint tensor is used exactly
once and each model parameter is filled exactly once, with its shape checked; anything else is a one-line
`UserError` naming the tensor. Family quirks live here, not in the model: OPT's learned positions carry an
offset of 2 rows, GPT-NeoX fuses Q, K and V per head into one matrix, Phi-3 fuses Q|K|V and gate|up, and a
Gemma 3 image-text checkpoint nests its decoder under `language_model` beside a vision tower that is skipped.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import Config, rope_inv_freq
from ..config_readers import read_config
from ..errors import UserError
from ..model import Transformer
from ..parallel import Shard

# (checkpoint-name regex, model-name template) per family; "model." prefixes are optional in the wild.
_LAYER = r"(?:model\.)?{}\.(\d+)\."
_LLAMA_SHARED = [  # what Phi-3 names as LLaMA does
    (r"(?:model\.)?embed_tokens\.weight", "tok_emb.weight"),
    (r"(?:model\.)?norm\.weight", "norm_f.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (_LAYER.format("layers") + r"input_layernorm\.weight", r"layers.\1.norm1.weight"),
    (_LAYER.format("layers") + r"post_attention_layernorm\.weight", r"layers.\1.norm2.weight"),
]
NAME_MAPS = {
    "llama": _LLAMA_SHARED + [
        (_LAYER.format("layers") + r"self_attn\.(q|k|v|o)_proj\.(weight|bias)", r"layers.\1.attn.w\2.\3"),
        (_LAYER.format("layers") + r"mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.mlp.w_\2.\3"),
    ],
    "phi3": _LLAMA_SHARED + [  # fused matrices, split in `rename`
        (_LAYER.format("layers") + r"self_attn\.qkv_proj\.weight", r"layers.\1.attn.wqkv_split.weight"),
        (_LAYER.format("layers") + r"self_attn\.o_proj\.weight", r"layers.\1.attn.wo.weight"),
        (_LAYER.format("layers") + r"mlp\.gate_up_proj\.weight", r"layers.\1.mlp.w_gate_up.weight"),
        (_LAYER.format("layers") + r"mlp\.down_proj\.weight", r"layers.\1.mlp.w_down.weight"),
    ],
    "opt": [
        (r"(?:model\.)?decoder\.embed_tokens\.weight", "tok_emb.weight"),
        (r"(?:model\.)?decoder\.embed_positions\.weight", "pos_emb.weight"),
        (r"(?:model\.)?decoder\.project_(in|out)\.weight", r"proj_\1.weight"),
        (r"(?:model\.)?decoder\.final_layer_norm\.(weight|bias)", r"norm_f.\1"),
        (r"lm_head\.weight", "lm_head.weight"),
        (_LAYER.format("decoder.layers") + r"self_attn\.(q|k|v|o)(?:ut)?_proj\.(weight|bias)", r"layers.\1.attn.w\2.\3"),
        (_LAYER.format("decoder.layers") + r"self_attn_layer_norm\.(weight|bias)", r"layers.\1.norm1.\2"),
        (_LAYER.format("decoder.layers") + r"final_layer_norm\.(weight|bias)", r"layers.\1.norm2.\2"),
        (_LAYER.format("decoder.layers") + r"fc1\.(weight|bias)", r"layers.\1.mlp.w_up.\2"),
        (_LAYER.format("decoder.layers") + r"fc2\.(weight|bias)", r"layers.\1.mlp.w_down.\2"),
    ],
    "gpt_neox": [
        (r"gpt_neox\.embed_in\.weight", "tok_emb.weight"),
        (r"gpt_neox\.final_layer_norm\.(weight|bias)", r"norm_f.\1"),
        (r"embed_out\.weight", "lm_head.weight"),
        (r"gpt_neox\.layers\.(\d+)\.input_layernorm\.(weight|bias)", r"layers.\1.norm1.\2"),
        (r"gpt_neox\.layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", r"layers.\1.norm2.\2"),
        (r"gpt_neox\.layers\.(\d+)\.attention\.query_key_value\.(weight|bias)", r"layers.\1.attn.wqkv.\2"),
        (r"gpt_neox\.layers\.(\d+)\.attention\.dense\.(weight|bias)", r"layers.\1.attn.wo.\2"),
        (r"gpt_neox\.layers\.(\d+)\.mlp\.dense_h_to_4h\.(weight|bias)", r"layers.\1.mlp.w_up.\2"),
        (r"gpt_neox\.layers\.(\d+)\.mlp\.dense_4h_to_h\.(weight|bias)", r"layers.\1.mlp.w_down.\2"),
    ],
}
# LLaMA's names, and Qwen3's per-head query/key norms
NAME_MAPS["qwen2"] = NAME_MAPS["mistral"] = NAME_MAPS["llama"]
NAME_MAPS["qwen3"] = NAME_MAPS["llama"] + [
    (_LAYER.format("layers") + r"self_attn\.(q|k)_norm\.weight", r"layers.\1.attn.\2_norm.weight")]
# Gemma: LLaMA's attention and MLP names, four norms per block (HF's post_attention_layernorm is the norm *after*
# attention here, not before the MLP), q/k norms (Gemma 3); a multimodal Gemma 3 nests it all under language_model
_GEMMA = r"(?:model\.)?(?:language_model\.)?(?:model\.)?"
NAME_MAPS["gemma2"] = NAME_MAPS["gemma3"] = [
    (_GEMMA + r"embed_tokens\.weight", "tok_emb.weight"),
    (_GEMMA + r"norm\.weight", "norm_f.weight"),
    (r"(?:language_model\.)?lm_head\.weight", "lm_head.weight"),
    (_GEMMA + r"layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.(weight|bias)", r"layers.\1.attn.w\2.\3"),
    (_GEMMA + r"layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", r"layers.\1.attn.\2_norm.weight"),
    (_GEMMA + r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.w_\2.weight"),
    (_GEMMA + r"layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.norm1.weight"),
    (_GEMMA + r"layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.post_attn_norm.weight"),
    (_GEMMA + r"layers\.(\d+)\.pre_feedforward_layernorm\.weight", r"layers.\1.norm2.weight"),
    (_GEMMA + r"layers\.(\d+)\.post_feedforward_layernorm\.weight", r"layers.\1.post_mlp_norm.weight"),
]
# Tensors that fill nothing: old GPT-NeoX checkpoints' buffers (recomputed, not weights); Gemma 3's vision tower.
_SKIPPED = {"gpt_neox": re.compile(r".*\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$"),
            "gemma3": re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..*")}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = _index_shards(index)
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise UserError(f"{folder} lacks the shard {missing[0]} listed in {index.name}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise UserError(f"{folder} has only pickled weights (*.bin/*.pt); h2o-mini loads safetensors only "
                        "(convert them with safetensors' tools first)")
    raise UserError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def _index_shards(index: Path) -> list[str]:
    """The shard files an index names: plain file names inside the folder, nothing else."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, AttributeError) as e:
        raise UserError(f"{index} is not a valid safetensors index: {e or 'not a JSON object'}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index} is not a valid safetensors index: no 'weight_map' object")
    bad = [s for s in weight_map.values() if not isinstance(s, str) or Path(s).name != s
           or not s.endswith(".safetensors")]
    if bad:
        raise UserError(f"{index} names the shard {bad[0]!r}: expected a *.safetensors file in the same folder")
    return sorted(set(weight_map.values()))


def read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the files, one at a time (a rank keeps only its shard of each)."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    # NaN/inf weights would only show up later as empty or NaN output
                    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        raise UserError(f"tensor {name} in the checkpoint holds NaN or infinite values")
                    yield name, tensor
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"cannot read {path}: {e} (truncated or not a safetensors file?)") from None


def rename(cfg: Config, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor -> the model tensors it fills, applying the family's quirks. An unknown name is a
    UserError; old NeoX buffers and Gemma 3's vision tower fill nothing."""
    for pattern, template in NAME_MAPS[cfg.family]:
        if re.fullmatch(pattern, name):
            target = re.sub(pattern, template, name)
            break
    else:
        if cfg.family in _SKIPPED and _SKIPPED[cfg.family].fullmatch(name):
            return []
        raise UserError(f"unexpected tensor {name} in the checkpoint (not part of a {cfg.family} model)")
    if target == "pos_emb.weight":  # OPT reserves rows 0-1 of its position table (HF's offset of 2)
        return [(target, tensor[2:])]
    if ".attn.wqkv." in target:  # NeoX: rows are (head, [q|k|v], head_dim)
        if tensor.shape[0] != 3 * cfg.n_head * cfg.head_dim:
            raise UserError(f"tensor {target} has shape {tuple(tensor.shape)}, not a fused QKV of this config")
        per_head = tensor.view(cfg.n_head, 3, cfg.head_dim, *tensor.shape[1:])
        return [(target.replace("wqkv", f"w{part}"), per_head[:, j].reshape(-1, *tensor.shape[1:]))
                for j, part in enumerate("qkv")]
    if target.endswith(".attn.wqkv_split.weight"):  # Phi-3: rows are [q (all heads) | k | v]
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        if tensor.shape[0] != q + 2 * kv:
            raise UserError(f"tensor {name} has shape {tuple(tensor.shape)}, not a fused QKV of this config")
        return [(target.replace("wqkv_split", f"w{part}"), t) for part, t in zip("qkv", tensor.split([q, kv, kv]))]
    if target.endswith(".mlp.w_gate_up.weight"):  # Phi-3: rows are [gate | up]
        if tensor.shape[0] != 2 * cfg.d_ff:
            raise UserError(f"tensor {name} has shape {tuple(tensor.shape)}, not a fused gate/up of this config")
        return [(target.replace("w_gate_up", part), t) for part, t in zip(("w_gate", "w_up"), tensor.chunk(2))]
    return [(target, tensor)]


# the model's split tensors -> the fused one a checkpoint holds (`rename` splits them), per family
_FUSED = {"gpt_neox": [(r"\.attn\.w[qkv]\.", ".attn.wqkv.")],
          "phi3": [(r"\.attn\.w[qkv]\.", ".attn.wqkv_split."), (r"\.mlp\.w_(gate|up)\.", ".mlp.w_gate_up.")]}


def checkpoint_name(cfg: Config, target: str, names: list[str]) -> str:
    """What the checkpoint would call the tensor that fills the model's `target`: spelt like the tensors of the
    same kind it does hold (another layer's), else from the name map's pattern with its optional parts left out."""
    candidates = [target] + [re.sub(pattern, fused, target) for pattern, fused in _FUSED.get(cfg.family, [])]
    for pattern, template in NAME_MAPS[cfg.family]:
        pieces = re.split(r"\\(\d)", template)  # literal, group number, literal, ...
        regex = "".join(re.escape(x) if i % 2 == 0 else r"([^.]+)" for i, x in enumerate(pieces))
        match = next((m for c in candidates if (m := re.fullmatch(regex, c))), None)
        if match is None:
            continue
        values = dict(zip(map(int, pieces[1::2]), match.groups()))
        for name in names:  # a tensor of the same kind: its spelling, with this one's layer (and part)
            seen = re.fullmatch(pattern, name)
            if seen:
                out, end = "", 0
                for k in range(1, len(seen.groups()) + 1):
                    out += name[end:seen.start(k)] + values.get(k, seen.group(k))
                    end = seen.end(k)
                return out + name[end:]
        groups = iter(values[k] for k in sorted(values))
        spelt = re.sub(r"\(\?:[^()]*\)\?|\([^()]*\)", lambda m: "" if m[0].startswith("(?:") else next(groups), pattern)
        return spelt.replace("\\.", ".")
    return target


def load_hf(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
            shard: Shard | None = None) -> Transformer:
    """The model in `folder`; with `shard`, only this tensor-parallel rank's slice of it (`parallel.py`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"model folder {folder} {'is a file, not a folder' if folder.exists() else 'does not exist'}")
    cfg = read_config(folder)
    local = shard.local_config(cfg) if shard else cfg
    with torch.device("meta"):
        model = Transformer(local, shard)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    weights, names = {}, []
    for name, tensor in read_tensors(safetensors_files(folder)):
        names.append(name)
        for target, t in rename(cfg, name, tensor):
            if target in weights:
                raise UserError(f"checkpoint tensor {name} maps to {target}, which another tensor already filled")
            if target not in expected:
                raise UserError(f"unexpected tensor {name} in the checkpoint for this config")
            t = shard.take(target, t) if shard else t
            if t.shape != expected[target]:
                raise UserError(f"tensor for {target} has shape {tuple(t.shape)}, expected {tuple(expected[target])}"
                                + (f" (this rank's 1/{shard.size})" if shard else ""))
            weights[target] = t.to(device=device, dtype=dtype)
    for name, shape in expected.items():
        if name not in weights:
            raise UserError(f"the checkpoint lacks the tensor {checkpoint_name(cfg, name, names)} (shape "
                            f"{tuple(shape)}; the model's {name})")
    model.load_state_dict(weights, assign=True)
    if cfg.rotary_dim:  # buffers are not in the checkpoint: computed here, off the meta device
        model.inv_freq = rope_inv_freq(cfg).to(device)
        if model.local_rope:
            model.inv_freq_local = rope_inv_freq(cfg, local=True).to(device)
    return model.requires_grad_(False).eval()

"""`--engine transformers`: h2o-mini's commands with transformers computing the model (the `hf` extra; nothing in
the core imports this module).

`TransformersModel` gives a transformers causal LM the shape h2o-mini's commands call (`cfg`, `forward(idx, pos,
cache)`, `hidden`, `head`, as `model.Transformer` has), so `generate`, `eval ppl`, `eval tasks` and `bench` run
it through the same `generate.Decoder`, the same `cache.KVCache` and the same sampling as h2o-mini's decoder:
every layer's attention reaches the h2o-mini cache through `transformers_cache.EvictingCache`. The same command
with either engine then differs only by what computes the projections, norms and MLPs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from .cache import KVCache
from .errors import UserError
from .model import softcap
from .policies import Full
from .transformers_cache import EvictingCache, model_config, use_attention


class TransformersModel(torch.nn.Module):
    """A transformers `PreTrainedModel` with h2o-mini's decoder's calls: idx, pos (B, T), negative pos = padding."""

    shard = None  # tensor parallel is h2o-mini's decoder's

    def __init__(self, hf):
        super().__init__()
        self.cfg = model_config(hf)  # a model the cache cannot hold is refused here, before any work
        self.hf = hf.eval().requires_grad_(False)
        use_attention(hf)
        self.cap = getattr(hf.config.get_text_config(), "final_logit_softcapping", None)  # Gemma 2
        self.view = None  # the EvictingCache transformers sees over the h2o-mini cache read last

    def forward(self, idx, pos, cache=None, last_only: bool = False) -> torch.Tensor:
        x = self.hidden(idx, pos, cache)
        return self.head(x[:, -1:] if last_only else x)  # (B, T, V) fp32

    def hidden(self, idx, pos, cache: KVCache | None = None) -> torch.Tensor:
        """The last layer's output (B, T, d_model), the model's final norm included. Without a cache, a causal
        pass (a cache that keeps every token reads a first prompt densely: causal attention)."""
        if cache is None:
            view = EvictingCache(self.cfg, Full(), idx.shape[1], "dense", None, False)
        else:
            if self.view is None or self.view.inner is not cache:  # a command reads through one cache at a time
                self.view = EvictingCache.over(self.cfg, cache)
            view = self.view
        real = view.mask(pos >= 0)  # (B, columns so far): transformers' 2D attention mask
        out = self.hf.base_model(input_ids=idx, attention_mask=real, position_ids=pos.clamp(min=0), cache=view,
                                 use_cache=True)
        return out.last_hidden_state

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(self.hf.get_output_embeddings()(x).float(), self.cap)


def load_transformers(folder: Path, dtype: torch.dtype, device: str) -> TransformersModel:
    """A local checkpoint folder through `AutoModelForCausalLM`: safetensors only, no remote code, no download."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # stderr keeps h2o-mini's own lines
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, use_safetensors=True,
                                                  trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"transformers cannot load {folder}: {first}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return TransformersModel(hf.to(device))

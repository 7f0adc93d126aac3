"""The heavy-hitter observation (H2O paper, Zhang et al., 2023, Sec. 3.2 / Fig. 2): in a full causal pass,
the attention each token receives, accumulated over every query and every query head of a layer, follows
a power law: a small share of the tokens gets most of the mass.

`accumulated_attention` reads it off the cache's own dense path: a `heavy_hitter` cache with C = N keeps
every token and, by the spec's dense rule, holds s_j = the sum over all prompt queries and the group's
query heads of p(j); summing over the KV heads gives the sum over all query heads.
"""
from __future__ import annotations

import math

import torch

from ..cache import KVCache
from ..model import Transformer
from ..policies import HeavyHitter


@torch.inference_mode()
def accumulated_attention(model: Transformer, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """layer -> (N,) fp32: the attention token j receives, summed over all N queries and all query heads."""
    N = len(ids)
    device = next(model.parameters()).device
    cache = KVCache(model.cfg, HeavyHitter(heavy=N), 1, N, dtype=next(model.parameters()).dtype, device=device)
    model(torch.tensor([ids], device=device), torch.arange(N, device=device)[None], cache, last_only=True)
    return {layer: cache.layers[layer].score[0].sum(0).cpu() for layer in layers}  # kept in position order


def top_share(received: torch.Tensor, share: float = 0.2) -> float:
    """The part of all attention mass held by the floor(share N) tokens that received the most."""
    k = math.floor(share * received.numel())
    return (received.sort(descending=True).values[:k].sum() / received.sum()).item()


def save_attention_plot(curves: dict[int, torch.Tensor], out, title: str) -> None:
    from ..views.plot import figure, save
    plt, fig, ax = figure(1, (6, 4.6))
    ax = ax[0]
    for layer, received in curves.items():
        ranked = received.sort(descending=True).values.clamp(min=1e-12).numpy()
        ax.loglog(range(1, len(ranked) + 1), ranked, label=f"layer {layer}: top 20% hold {top_share(received):.0%}")
    ax.set_xlabel("token rank (by attention received)")
    ax.set_ylabel("accumulated attention received")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    save(plt, fig, out)

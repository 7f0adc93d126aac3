"""`h2o-mini plot kept`: which tokens each policy keeps, step by step, as one picture.

A real text goes through the model one token at a time (teacher forcing) under each policy; after every
step the cached positions of one layer and KV head are recorded. The picture has the step t across and the
position p down: a cell is dark while token p is in the cache at step t. `local` draws a diagonal band;
`h2o` draws the same band plus horizontal lines, the heavy hitters it keeps for a long time.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .api import LM
from .errors import UserError
from .files import write_atomic
from .generate import Decoder
from .policies import Policy


@torch.inference_mode()
def kept_matrix(lm: LM, ids: list[int], policy: Policy, layer: int, head: int) -> torch.Tensor:
    """(T, T) bool: [p, t] is True when position p is cached after step t, in `layer`, KV `head`, row 0."""
    cfg = lm.model.cfg
    if not 0 <= layer < cfg.n_layer or not 0 <= head < cfg.n_kv_head:
        raise UserError(f"--layer must be in [0, {cfg.n_layer}) and --head in [0, {cfg.n_kv_head})")
    T = len(ids)
    device = next(lm.model.parameters()).device
    decoder = Decoder(lm.model)
    cache = decoder.new_cache(policy, 1, T)
    x = torch.tensor([ids], device=device)
    kept = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        decoder.step(lm.model, cache, x[:, t:t + 1], torch.tensor([[t]], device=device))
        cached = cache.layers[layer].pos[0, head]
        kept[cached[cached >= 0].cpu(), t] = True
    return kept


def save_kept_plot(matrices: dict[str, torch.Tensor], out: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'h2o-mini[plot]'") from None
    n = len(matrices)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 4.4), squeeze=False)
    for ax, (label, kept) in zip(axes[0], matrices.items()):
        ax.imshow(kept.numpy(), cmap="Greys", interpolation="nearest", aspect="auto")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step t (token arriving)")
        ax.set_ylabel("position p (token kept)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    try:
        write_atomic(out, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)

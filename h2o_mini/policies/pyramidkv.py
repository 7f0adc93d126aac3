"""`pyramidkv`: PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling", arXiv 2406.02069).

Lower layers spread their attention widely, upper layers focus it on a few tokens, so PyramidKV gives
lower layers more cache and upper layers less, for the same total memory as a uniform C. The exact rule:
every layer keeps the same `window` of recent tokens; the heavy share shrinks linearly with depth, from
2 * heavy - heavy / beta in layer 0 to heavy / beta in the last layer (mean: `heavy`), rounded so that the
shares add up to n_layer * heavy exactly (floor of the running sum). A layer never holds more than the
sequence; when C >= L every layer holds all of it. Within each layer the selection is SnapKV's (the
observation window's attention, max-pooled), and decoding goes on by the H2O rule, as in `snapkv`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .snapkv import SnapKV
from ..errors import UserError


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV with per-layer capacities that shrink linearly with depth (`beta`: how much smaller the top
    layer's heavy share is than the mean), the same total as a uniform C = `heavy` + `window`."""

    beta: int = 20
    name = "pyramidkv"

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise UserError(f"PyramidKV: beta={self.beta} must be at least 1 (1: the same share in every layer)")

    def layer_capacity(self, layer: int, n_layer: int, length: int) -> int:
        if self.capacity >= length or n_layer == 1:
            return min(self.capacity, length)
        top = self.heavy / self.beta
        bottom = min(2 * self.heavy - top, length - self.window)  # a layer never holds more than L
        top = 2 * self.heavy - bottom  # keep the total where the cap took from the bottom layers
        share = lambda i: bottom + (top - bottom) * i / (n_layer - 1)  # noqa: E731  heavy share of layer i
        running = lambda i: math.floor(sum(share(j) for j in range(i)) + 1e-9)  # noqa: E731
        return min(length, self.window + running(layer + 1) - running(layer))

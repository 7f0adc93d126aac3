"""`expected_attention`: Expected Attention (Devoto, Jeblick and Jegou, 2025, "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution", arXiv 2510.00636; kvpress's
`ExpectedAttentionPress`).

Every other rule here looks back: the attention a token has received, its age, its key's norm. This one
predicts the attention still to come. The queries seen so far, with their rotary embedding undone, are taken
as samples of a Gaussian (mean m, covariance S per query head). A query at a future position s is that vector
rotated by RoPE to s; averaged over the next `future` positions the rotation is a fixed matrix A (each channel
pair turned by the mean cosine and sine of its angles), so the future query has mean A m and covariance
A S A^T. For a Gaussian q, E[exp(q . k / sqrt(d))] = exp(k . A m / sqrt(d) + k^T A S A^T k / 2d): a key's
expected attention in closed form. The scores are a softmax over the cached keys, averaged over the query heads
of the KV head's group, and (`vnorm`) weighted by the value's norm, since a token's contribution to the output
is its attention times its value. The first `sink` tokens are kept, and their queries are left out of the
statistics (their outliers would dominate them), as in the paper's code.

The statistics are a running state per (row, query head) that the cache holds (`Policy.observe`, docs/spec.md):
the mean and covariance of every query from position `sink` on, updated at each token (Welford's update, so the
sums never lose precision to cancellation), and A m, A S A^T for the positions after the newest token. In a
dense prompt the statistics are those of the whole prompt and the future starts after it: kvpress's press,
whose choice of prompt tokens `scripts/peers` compares. While decoding, the same rule runs at every eviction,
as the paper applies it in decoding. For a model without RoPE (OPT) A is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, param


@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """Keep `keep` tokens: the `sink` first always, and the others by the attention the next `future` queries are
    expected to pay them (a Gaussian fitted to the queries so far, RoPE averaged over those positions) times their
    value's norm; a full cache evicts the lowest (ties: the oldest)."""

    keep: int
    recent: int = 0  # the newest tokens, always kept (the paper keeps none in a prompt; see from_budget)
    future: int = param(32, lo=1)  # the positions ahead RoPE is averaged over (the paper's n_future_positions: 512)
    sink: int = 4  # the first tokens, always kept, whose queries stay out of the statistics (n_sink)
    covariance: bool = True  # the covariance term (False: the mean query alone)
    vnorm: bool = True  # weight each token's expected attention by its value's norm
    name = "expected_attention"
    takes_recent = True

    @property
    def capacity(self) -> int:
        return self.keep

    def state_size(self, head_dim: int) -> int:
        return 1 + 2 * head_dim + 2 * head_dim * head_dim * self.covariance  # n; m, S; A m, A S A^T

    def _unpack(self, state: torch.Tensor, d: int):
        """state (B, H, g, n) for head_dim d -> count (B, H, g, 1), m and A m (B, H, g, d), S and A S A^T
        (B, H, g, d, d) or None."""
        count, rest = state[..., :1], state[..., 1:]
        mean, ahead = rest[..., :d], rest[..., d:2 * d]
        if not self.covariance:
            return count, mean, ahead, None, None
        cov = rest[..., 2 * d:2 * d + d * d].unflatten(-1, (d, d))
        cov_ahead = rest[..., 2 * d + d * d:].unflatten(-1, (d, d))
        return count, mean, ahead, cov, cov_ahead

    def observe(self, state, queries, t, rope) -> torch.Tensor:
        count, mean, _, cov, _ = self._unpack(state, queries.shape[-1])
        q = queries.float()  # (B, H, g, d)
        if rope is not None:  # undo the rotation to t: the query as the model projected it
            q = rope.rotate(q, -t)  # t (B, 1, 1) against (B, H, g)
        counts = (t[..., None] >= self.sink).float()  # (B, 1, 1, 1): a sink's query is left out
        count = count + counts
        rate = counts / count.clamp(min=1)  # Welford: 1 / n for the n-th query counted, else 0
        delta = q - mean
        mean = mean + rate * delta
        if cov is not None:
            cov = (1 - rate)[..., None] * (cov + rate[..., None] * delta[..., :, None] * delta[..., None, :])
        return self._pack(count, mean, cov, t, rope)

    def observe_many(self, state, queries, pos, rope) -> torch.Tensor:
        """`observe` for Q tokens at once: the block's own mean and covariance merged into the running ones (the
        pairwise update of Chan, Golub and LeVeque, 1979), A taken after each row's last real token."""
        count, mean, _, cov, _ = self._unpack(state, queries.shape[-1])
        p = pos[:, None, None, :]  # (B, 1, 1, Q)
        q = queries.float()  # (B, H, g, Q, d)
        if rope is not None:
            q = rope.rotate(q, -p)
        w = (p >= self.sink).float()[..., None]  # (B, 1, 1, Q, 1): counted (padding, pos < 0, is not)
        n_block = w.sum(-2)  # (B, 1, 1, 1)
        mean_block = (w * q).sum(-2) / n_block.clamp(min=1)  # (B, H, g, d)
        count = count + n_block
        share = n_block / count.clamp(min=1)  # the block's share of every query counted
        delta = mean_block - mean
        mean = mean + share * delta
        if cov is not None:
            centred = q - mean_block[..., None, :]  # (B, H, g, Q, d)
            cov_block = (w * centred).transpose(-1, -2) @ centred / n_block[..., None].clamp(min=1)
            cov = ((1 - share)[..., None] * cov + share[..., None] * cov_block
                   + (share * (1 - share))[..., None] * delta[..., :, None] * delta[..., None, :])
        last = pos.amax(-1)[:, None, None]  # (B, 1, 1): each row's last token
        return torch.where(last[..., None] >= 0, self._pack(count, mean, cov, last, rope), state)

    def _pack(self, count, mean, cov, t, rope) -> torch.Tensor:
        """The state after the token at t: the statistics, and A m, A S A^T for the positions after t."""
        parts = [count, mean, self._ahead(mean, t, rope, vector=True)]
        if cov is not None:
            parts += [cov.flatten(-2), self._ahead(cov, t, rope, vector=False).flatten(-2)]
        return torch.cat(parts, -1)

    def _ahead(self, x, t, rope, vector: bool) -> torch.Tensor:
        """A x (a mean) or A x A^T (a covariance), A the rotation averaged over positions t + 1 .. t + future."""
        if rope is None:
            return x
        first = t + 1 if vector else (t + 1)[..., None]  # broadcastable to x.shape[:-1]
        if vector:
            return rope.average(x, first, self.future)
        half = rope.average(x, first, self.future)  # rows turned: S A^T
        return rope.average(half.transpose(-1, -2), first, self.future)  # (A S A^T)^T, symmetric

    def expected(self, pos, keys, state) -> torch.Tensor:
        """(B, H, S): each token's expected share of the next queries' attention, over the tokens from `sink` on
        (0 for the others), averaged over the group's query heads. pos, keys as `keep_score` has them."""
        counted = (pos >= self.sink)[:, :, None]  # (B, H, 1, S)
        B, H, S, d = keys.shape
        if state is None:  # no query yet (a policy's own checks): every token expected alike
            logits = keys.new_zeros(B, H, 1, S, dtype=torch.float32)
        else:
            _, _, ahead, _, cov_ahead = self._unpack(state, d)
            k = keys.float()
            logits = ahead @ k.transpose(-1, -2) / d ** 0.5  # (B, H, g, S): E[q] . k / sqrt(d)
            if cov_ahead is not None:  # + k^T Cov[q] k / 2d
                logits = logits + torch.einsum("bhsd,bhgde,bhse->bhgs", k, cov_ahead, k) / (2 * d)
        return logits.masked_fill(~counted, -torch.inf).softmax(-1).nan_to_num(0.0).mean(2)

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        expected = self.expected(pos, keys, state)  # (B, H, S)
        if self.vnorm:
            expected = expected * values.float().norm(dim=-1)
        kept = (pos >= 0) & ((pos < self.sink) | (pos > t - self.recent))  # kept whatever they are expected to get
        return expected.masked_fill(kept, torch.inf)

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "ExpectedAttention":
        """Decoding one token at a time, half of C is a recent window (as h2o's), unless --recent says otherwise:
        a new token has been seen by no query yet, and with the paper's 512 positions averaged the prediction is
        smooth enough to evict it at once. Both defaults (recent C/2, future 32) were chosen on the Apache-2.0
        licence (docs/results.md section 12), not on the texts the results are read on."""
        sink = min(4, capacity - 1)
        recent = capacity // 2 if recent is None else recent
        return cls(keep=capacity, sink=sink, recent=max(0, min(recent, capacity - 1 - sink)))

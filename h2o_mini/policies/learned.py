"""`learned`: a keep-score fitted to the hindsight reference (`hindsight.py`) on one text, run causally.

`hindsight` keeps the tokens that the full cache's future queries will attend most: the right answer, read off
the text ahead. This rule learns to guess it from what the cache knows at each step. Per layer it is a linear
function of eight features of a cached token j at the arriving position t:

    log a_j, log(a_j / age), log age, 1 / age, log |k_j|, log |v_j|, log e_j, q_t . k_j / sqrt(d)

a_j the attention j has received so far (H2O's sum, the cache's score), age = t - p_j, e_j Expected Attention's
prediction of the share the next queries will give j (`expected_attention.py`: a Gaussian fitted to the queries
so far), and q_t . k_j the arriving token's own logit to j (averaged over the group's query heads). The first
`sink` tokens and the `recent` newest are kept. `h2o-mini learn-policy` fits the weights (least squares on the
log of the attention still to come, each eviction's candidates centred on their mean, so only the ranking within
one choice is fitted) from a full pass over one text, and writes them with the model they belong to; `--policy
learned:weights=FILE` runs them, and refuses a file made for another model. The features come from the full pass when fitting and from the
evicting cache when running: the scores a token received under eviction are not those it received with every
token present, one reason a fitted rule can miss on a text it was fitted to.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

import torch

from ..errors import UserError
from .base import Policy, param
from .expected_attention import ExpectedAttention
from .h2o import H2O

FEATURES = ("log_attention", "log_mean_attention", "log_age", "inverse_age", "log_key_norm", "log_value_norm",
            "log_expected", "query_logit")


def model_id(cfg) -> dict:
    """What a fitted rule must match: the model's shape (the same under tensor parallel), not its file name."""
    return {k: getattr(cfg, k) for k in ("family", "vocab_size", "n_layer", "d_model", "head_dim", "rotary_dim",
                                         "rope_theta")}


def features(score, pos, t, keys, values, expected, query) -> torch.Tensor:
    """(B, H, S, 8) the FEATURES of every slot. score, pos: (B, H, S); t: broadcastable; keys, values: (B, H, S, d);
    expected: (B, H, S) Expected Attention's share; query: (B, H, g, d) the arriving token's, after RoPE."""
    age = (t - pos).clamp(min=1).float()
    tiny = 1e-6
    logit = (query.float() @ keys.float().transpose(-1, -2)).mean(2) / keys.shape[-1] ** 0.5  # (B, H, S)
    return torch.stack([score.clamp(min=0).add(tiny).log(), (score.clamp(min=0) / age).add(tiny).log(), age.log(),
                        1 / age, keys.float().norm(dim=-1).add(tiny).log(), values.float().norm(dim=-1).add(tiny).log(),
                        expected.add(tiny).log(), logit], -1)


@dataclass(frozen=True)
class Learned(Policy):
    """Keep `keep` tokens: the `sink` first always, and the others by a per-layer linear score of causal features
    (attention received, age, key and value norms, Expected Attention, the current query's logit) fitted to the
    hindsight reference by `h2o-mini learn-policy`; a full cache evicts the lowest (ties: the oldest)."""

    keep: int
    weights: str = "none"  # the fitted rule (a .safetensors file from `h2o-mini learn-policy`)
    recent: int = 0  # the newest tokens, always kept (from_budget: half of C, as h2o's)
    sink: int = 4
    future: int = param(512, lo=1)  # Expected Attention's look-ahead, a feature
    layer: int = param(-1, lo=-1)  # the layer whose weights run (-1 until the cache's `for_layer` sets it)
    name = "learned"
    needs_scores = True
    takes_recent = True

    def __post_init__(self):
        # (n_layer, 8) weights and what they were fitted to; none yet for `from_budget`'s policy, before the spec's
        # weights=FILE replaces it (`make_policy`)
        object.__setattr__(self, "_table", None if self.weights == "none" else _load(self.weights))
        # the Expected Attention whose statistics and prediction are a feature (made here, not in the compiled step)
        object.__setattr__(self, "_expected", ExpectedAttention(keep=max(self.keep, 1), future=self.future,
                                                                sink=self.sink, vnorm=False))
        super().__post_init__()

    @property
    def capacity(self) -> int:
        return self.keep


    def for_model(self, cfg) -> "Learned":
        if self._table is None:
            raise UserError("policy 'learned' needs its fitted weights: --policy learned:weights=FILE "
                            "(a .safetensors file from `h2o-mini learn-policy`)")
        weights, meta = self._table
        if meta["model"] != model_id(cfg):
            raise UserError(f"{self.weights}: fitted to another model ({meta['name']}, {meta['model']['family']} with "
                            f"{meta['model']['n_layer']} layers), not this {cfg.family} with {cfg.n_layer} layers")
        return self

    def for_layer(self, layer: int, n_layer: int) -> "Learned":
        bound = copy.copy(self)  # with the weights already read: the file is read once, not once per layer
        object.__setattr__(bound, "layer", layer)  # a field: layers' policies differ, so no batch merges their rows
        return bound

    def state_size(self, head_dim: int) -> int:  # Expected Attention's statistics, then the arriving query
        return self._expected.state_size(head_dim) + head_dim

    def observe(self, state, queries, t, rope) -> torch.Tensor:
        d = queries.shape[-1]
        return torch.cat([self._expected.observe(state[..., :-d], queries, t, rope), queries.float()], -1)

    def keep_score(self, score, pos, t, keys=None, values=None, state=None) -> torch.Tensor:
        table = self._table[0] if self._table is not None else torch.zeros(1, len(FEATURES))
        weights = table[max(self.layer, 0)].to(keys.device)  # (8,)
        if state is None:  # a caller that holds no state for it (a test of the features alone)
            state = keys.new_zeros(*keys.shape[:2], 1, self.state_size(keys.shape[-1]), dtype=torch.float32)
        d = keys.shape[-1]
        expected = self._expected.expected(pos, keys, state[..., :-d])
        keep = features(score, pos, t, keys, values, expected, state[..., -d:]) @ weights  # (B, H, S)
        return keep.masked_fill((pos >= 0) & ((pos < self.sink) | (pos > t - self.recent)), torch.inf)

    update, accumulate = H2O.update, H2O.accumulate  # attention received, a feature: H2O's sum (policies/h2o.py)

    @classmethod
    def from_budget(cls, capacity: int, recent: int | None) -> "Learned":
        sink = min(4, capacity - 1)
        recent = capacity // 2 if recent is None else recent
        return cls(keep=capacity, sink=sink, recent=max(0, min(recent, capacity - 1 - sink)))


def _load(path: str):
    """(weights (n_layer, 8) fp32, metadata) from a safetensors file `learn-policy` wrote; anything else: one line."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, "pt") as f:
            meta, weights = f.metadata() or {}, f.get_tensor("weights").float()
    except FileNotFoundError:
        raise UserError(f"learned: no such weights file {path!r} (make one with `h2o-mini learn-policy`)") from None
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise UserError(f"learned: {path!r} is not a rule from `h2o-mini learn-policy` ({e})") from None
    try:
        info = json.loads(meta["h2o_mini_rule"])
        ok = info["features"] == list(FEATURES) and weights.shape == (info["model"]["n_layer"], len(FEATURES))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok or not all(math.isfinite(x) for x in weights.flatten().tolist()):
        raise UserError(f"learned: {path!r} is not a rule from `h2o-mini learn-policy` (its metadata or weights "
                        "do not describe this rule's features)")
    return weights, info

"""`hindsight`: H2O's rule scored with the attention still to come, a reference that only an evaluation can run.

H2O (`h2o.py`) keeps the tokens that *past* queries attended most, betting that they are the ones future queries
will attend. This policy reads the answer off the text instead: a first pass with the full cache records, per
layer and KV head (GQA summed), the attention A[q, j] every query q pays every token j; the evaluated pass then,
at each eviction at position t, keeps the `recent - 1` newest tokens (as h2o does) and evicts, among the others,
the one with the least attention still to come from the full pass's queries q >= t (ties: the oldest):

    keep_score(j at time t) = sum over q >= t of A_full[q, j]

It needs the whole text ahead, so it runs only in `eval ppl` / `eval sweep ppl` (`evals/hindsight.py`); every
other command refuses it. What it shows is a *reference*, not a bound: it is greedy (one eviction at a time,
never revisited), it optimises the full cache's attention mass rather than the loss, and once tokens are
evicted the evaluated pass attends differently from the full one. A policy can beat it; a policy far below it
at the same budget has room left that a better choice of tokens could take.
"""
from __future__ import annotations

from dataclasses import dataclass

from .h2o import H2O


@dataclass(frozen=True)
class Hindsight(H2O):
    """Keep the `recent` newest tokens and the `heavy` that the full cache's future queries will attend most
    (evaluation only: it reads the text ahead); a full cache evicts the lowest such token (ties: the oldest)."""

    name = "hindsight"
    lookahead = True

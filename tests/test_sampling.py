"""Sampling (generate.sample): greedy where the rule leaves one token, seeded draws reproducible, never outside
the top k."""
import torch

from h2o_mini.generate import Sampling, sample


def test_sampling_rules():
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, Sampling()), greedy)
    assert torch.equal(sample(logits, Sampling(temperature=1.0, top_k=1)), greedy)
    assert torch.equal(sample(logits, Sampling(temperature=1.0, top_p=1e-6)), greedy)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = sample(logits, Sampling(temperature=0.8, top_k=10), g())
    assert torch.equal(a, sample(logits, Sampling(temperature=0.8, top_k=10), g()))  # seeded: reproducible
    top10 = logits.topk(10, -1).indices
    draws = torch.stack([sample(logits, Sampling(temperature=2.0, top_k=10)) for _ in range(200)], 1)
    assert all(set(draws[r].tolist()) <= set(top10[r].tolist()) for r in range(4))  # never outside the top k
    assert len(set(draws[0].tolist())) > 1  # and really random

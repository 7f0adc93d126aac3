"""Evaluations of what a policy costs in quality, one file each: `ppl` (perplexity and fidelity to full),
`harness` (lm-evaluation-harness tasks), `needle` (needle in a haystack), `attention` (the heavy-hitter
power law), `sweep` (every policy at every budget), `bench` (what it costs in time and memory)."""

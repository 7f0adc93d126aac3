"""h2o-mini's dense prefill beside kvpress's presses (an independent implementation), on the same weights and text.

For each model (the default SmolLM2-135M and a tiny seeded Qwen3-shaped checkpoint), the first 400 tokens of
the GPL-3 are the prompt and the 401st is fed after it. kvpress (its own venv: `kvpress_side.py`) compresses
the prompt with each press at compression ratios 0.5 and 0.8; h2o-mini keeps the same number of tokens with
the matching policy and settings in a dense prefill. Compared per layer and KV head: the positions kept (the
share in common, and how many (layer, head) sets are equal), and the next token's logits after the prefill,
each computed the way kvpress runs them (the prompt attends causally, the new token attends the kept tokens
and itself). Run by `scripts/peers/run_kvpress.sh`, which writes results/peers/kvpress_results.md.

    python scripts/peers/kvpress_check.py KVPRESS_PYTHON WORK_DIR
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from h2o_mini import api
from h2o_mini.cache import KVCache
from h2o_mini.evals.hindsight import masked_logits
from h2o_mini.policies import make_policy
from h2o_mini.weights.hf import load_hf

SIDE = Path(__file__).with_name("kvpress_side.py")
GPL3 = Path("/usr/share/common-licenses/GPL-3")
T = 400  # prompt tokens
WINDOW, KERNEL = 64, 5  # kvpress's SnapKV / PyramidKV defaults
RULES = Path(__file__).with_name("kvpress_rules.py")
# press -> (h2o-mini policy, its parameters for n kept tokens); ALIGNED: the same with kvpress's rule (a plugin)
ALIGNED = {"knorm": f"{RULES}:ExactKNorm", "snapkv": f"{RULES}:AvgPoolSnapKV", "tova": f"{RULES}:SharedTOVA",
           "observed_attention": f"{RULES}:MeanObserved"}
MATCH = {
    "streaming_llm": ("sinks", lambda n: {"sink": 4, "recent": n - 4}),
    "knorm": ("knorm", lambda n: {"keep": n}),
    "snapkv": ("snapkv", lambda n: {"heavy": n - WINDOW, "window": WINDOW, "kernel": KERNEL}),
    "tova": ("tova", lambda n: {"keep": n}),
    "observed_attention": ("heavy_hitter", lambda n: {"heavy": n}),
    "keydiff": ("keydiff", lambda n: {"keep": n}),
    "pyramidkv": ("pyramidkv", lambda n: {"heavy": n - WINDOW, "window": WINDOW, "kernel": KERNEL}),
    # the paper's prompt settings (kvpress's defaults): 512 positions ahead, 4 sinks, no recent window
    "expected_attention": ("expected_attention", lambda n: {"keep": n, "future": 512, "sink": 4, "recent": 0}),
}


def tiny_qwen3(folder: Path) -> Path:
    """A small Qwen3 (per-head q/k norms, GQA 4:2, head_dim 32, 4 layers) with seeded weights, byte ids."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      use_sliding_window=False)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.15 if p.ndim >= 2 else 1 + noise * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def ours(lm_model, ids: list[int], press: str, n_kept: int, aligned: bool = False):
    """Kept positions per layer, (H, n) sorted, and the next token's logits, under the matching policy (with
    kvpress's rule: `aligned`)."""
    name, params = MATCH[press]
    name = ALIGNED[press] if aligned else name
    policy = make_policy(f"{name}:" + ",".join(f"{k}={v}" for k, v in params(n_kept).items()), n_kept, T)
    cache = KVCache(lm_model.cfg, policy, 1, T)
    with torch.no_grad():
        lm_model(torch.tensor([ids[:T]]), torch.arange(T)[None], cache, last_only=True)
    kept = [layer.pos[0].sort(-1).values for layer in cache.layers]  # (H, C_layer)
    leave = []
    for positions in kept:
        table = torch.full((positions.shape[0], T + 1), T, dtype=torch.int64)  # evicted when the new token arrives
        table.scatter_(1, positions, T + 1)
        table[:, T] = T + 1
        leave.append(table)
    logits = torch.cat([x for _, x in masked_logits(lm_model, ids[:T + 1], leave)], 1)[0, -1]
    return kept, logits


def compare(label: str, folder: Path, ids: list[int], kvpress_python: str, work: Path) -> list[str]:
    (work / "ids.json").write_text(json.dumps({"ids": ids[:T + 1]}))
    out = work / f"{label}.safetensors"
    quiet = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
    subprocess.run([kvpress_python, str(SIDE), str(folder), str(work / "ids.json"), str(out)], check=True, env=quiet)
    theirs = load_file(out)
    model = load_hf(folder)
    full = theirs["full/logits"]
    rows = []
    for press, ratio, aligned in [(p, r, a) for p in MATCH for a in (False, True)[:1 + (p in ALIGNED)]
                                  for r in (0.5, 0.8)]:
        tag = f"{press}/{ratio}"
        layers = sorted(int(k.split("/")[-1]) for k in theirs if k.startswith(f"{tag}/kept/"))
        n_kept = theirs[f"{tag}/kept/0"].shape[-1] if press != "pyramidkv" else int(T * (1 - ratio))
        kept, logits = ours(model, ids, press, n_kept, aligned)
        common, equal, sets = 0.0, 0, 0
        for layer in layers:
            a, b = kept[layer], theirs[f"{tag}/kept/{layer}"]
            for h in range(a.shape[0]):
                sa, sb = set(a[h].tolist()), set(b[h].tolist())
                common += len(sa & sb) / max(len(sa), len(sb))
                equal += sa == sb
                sets += 1
        sizes = f"{kept[0].shape[-1]}/{theirs[f'{tag}/kept/0'].shape[-1]}"
        if f"{tag}/logits" in theirs:
            diff = f'{(logits - theirs[f"{tag}/logits"]).abs().max().item():.2e}'
            agree = str(int(logits.argmax() == theirs[f"{tag}/logits"].argmax()))
        else:  # kvpress could not decode after it (see kvpress_side.py)
            diff = agree = "n/a"
        policy = ALIGNED[press].split(":")[-1] if aligned else MATCH[press][0]
        rows.append(f"| {label} | {press} -> {policy} | {ratio} | {sizes} | {common / sets:.3f} | "
                    f"{equal}/{sets} | {diff} | {agree} | {(logits - full).abs().max().item():.2e} |")
    return rows


def main(kvpress_python: str, work: str):
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    lm = api.load("default")
    smol = lm.tokenizer.encode(GPL3.read_text())
    tiny = tiny_qwen3(work / "tiny_qwen3")
    rows = compare("SmolLM2-135M", lm.folder, smol, kvpress_python, work)
    rows += compare("tiny Qwen3", tiny, list(GPL3.read_bytes()[:T + 1]), kvpress_python, work)
    print("| model | press -> policy | ratio | kept (layer 0: ours/theirs) | positions in common | equal sets | "
          "max abs logit diff | same top-1 | ours vs full |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(*sys.argv[1:])

"""The H2O paper's system benchmark, shaped like it: OPT-6.7B with random weights, 2048-token prompts + 2048 new
tokens, full vs h2o at 0.2, (1) at the same batch (latency: prefill + decode seconds) and (2) each at the
largest batch whose cache fits the GPU (throughput: decode tokens/s). Random weights decode exactly as fast as
trained ones (static shapes); they are made in memory (13 GB of noise is not worth writing to disk), with
4096 learned positions so that 2048 + 2048 fits. `--dry-run`: the same steps, a tiny OPT on CPU, in seconds.

Run: python scripts/gpu/opt_random.py [--dry-run] OUT_DIR   -> OUT_DIR/opt_random.jsonl and opt_random.md
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch

from h2o_mini.evals.bench import bench_one
from h2o_mini.config_readers import read_config
from h2o_mini.files import write_atomic
from h2o_mini.generate import Decoder
from h2o_mini.model import Transformer
from h2o_mini.policies import make_policy

OPT_6_7B = dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32, num_attention_heads=32, vocab_size=50272)
TINY = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)


def random_opt(shape: dict, dtype: torch.dtype, device: str) -> Transformer:
    """An OPT of this shape, weights ~ N(0, 0.02) (norms 1, biases 0), built on `device` without a file."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(dict(
            model_type="opt", max_position_embeddings=4096, word_embed_proj_dim=shape["hidden_size"], **shape)))
        cfg = read_config(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device).requires_grad_(False).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)  # LayerNorm 1, 0; biases 0
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="a tiny OPT on CPU, a few tokens")
    ap.add_argument("--latency-batch", type=int, default=16)
    args = ap.parse_args()
    dry = args.dry_run
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    prompt, new = (24, 8) if dry else (2048, 2048)
    model = random_opt(TINY if dry else OPT_6_7B, dtype, device)
    decoder = Decoder(model)  # eager: compiling 32 layers for 4 shapes would take most of the 10 minutes
    ids = torch.randint(3, model.cfg.vocab_size, (4096, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    configs = [("full", None), ("h2o", "0.2")]
    if dry:
        free = 8 * decoder.cache_bytes(make_policy("full", None, prompt + new), 1, prompt + new)
    else:
        torch.cuda.empty_cache()
        free = int(torch.cuda.mem_get_info()[0] * 0.85)  # the rest for activations and the allocator
    rows = []
    for kind in ("latency", "throughput"):
        for name, budget in configs:
            per_row = decoder.cache_bytes(make_policy(name, budget, prompt + new), 1, prompt + new)
            batch = min(args.latency_batch, 2 if dry else 4096) if kind == "latency" else min(4096, free // per_row)
            row = bench_one(model, decoder, name, budget, ids[:batch], new, same_prompt=kind == "throughput",
                            label=f"{kind} {name} batch={batch}")
            row.update(kind=kind, model="OPT-6.7B shape, random weights" if not dry else "tiny OPT (dry run)",
                       latency_s=round(row["prefill_s"] + row["decode_s"], 3))
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "opt_random.jsonl", lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in rows)))
    write_atomic(args.out / "opt_random.md", lambda tmp: tmp.write_text(table(rows)))


def table(rows: list[dict]) -> str:
    """Markdown: each run, and full / h2o for latency (seconds) and throughput (tokens/s)."""
    lines = ["| run | policy | batch | prompt + new | prefill s | decode s | latency s | decode tok/s | KV bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['policy']} {r['budget'] or ''} | {r['batch']} | {r['prompt_tokens']} + "
                     f"{r['new_tokens']} | {r['prefill_s']} | {r['decode_s']} | {r['latency_s']} | "
                     f"{r['decode_tok_s']} | {r['kv_bytes']} |")
    lat = {r["policy"]: r["latency_s"] for r in rows if r["kind"] == "latency"}
    thr = {r["policy"]: r["decode_tok_s"] or 0.0 for r in rows if r["kind"] == "throughput"}
    lines += ["", f"latency full / h2o: {lat['full'] / lat['h2o']:.2f}x (the paper: 1.9x lower); "
              f"throughput h2o / full: {thr['h2o'] / max(thr['full'], 1e-9):.2f}x"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

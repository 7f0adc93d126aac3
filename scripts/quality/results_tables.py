"""Prints the markdown tables of docs/results.md from the JSON lines scripts/quality/run_results.sh writes.

    python scripts/quality/results_tables.py [results]              # scripts/quality/run_results.sh
    python scripts/quality/results_tables.py results leaderboard  # scripts/quality/run_leaderboard.sh
    python scripts/quality/results_tables.py results workbench    # scripts/quality/run_workbench.sh
    python scripts/quality/results_tables.py results models       # scripts/quality/run_two_models.sh
    python scripts/quality/results_tables.py results hindsight    # scripts/quality/run_hindsight.sh
    python scripts/quality/results_tables.py results generate     # scripts/quality/run_generate.sh
    python scripts/quality/results_tables.py results lookahead    # scripts/quality/run_lookahead.sh
"""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "results")


def rows(name):
    """The JSON lines of the file `name` anywhere under `out` (results/ keeps them in folders by subject)."""
    path = next(out.rglob(name), None)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path else []


def leaderboard():
    """The policy leaderboard and the quantization table (scripts/quality/run_leaderboard.sh)."""
    for text in ("GPL-3", "GFDL-1.3"):
        board = rows(f"leaderboard_{text}.jsonl")
        if not board:
            continue
        full = next(r for r in board if r["policy"] == "full")
        h2o = {r["budget"]: r["ppl"] for r in board if r["policy"] == "h2o"}
        print(f"\n### {text}, 2048 tokens (full: ppl {full['ppl']:.2f}, KV {full['kv_bytes'] / 2**20:.1f} MiB)\n")
        print("ppl / top-1 agreement with full / KL(full || policy) in nats / KV MiB; *gap*: the share of h2o's "
              "perplexity gap to full that the policy closes (negative: wider)\n")
        budgets = sorted({r["budget"] for r in board if r["budget"]}, key=float)
        print("| policy | " + " | ".join(f"{b}: ppl / top-1 / KL / MiB | gap" for b in budgets) + " |")
        print("|---|" + "---|---|" * len(budgets))
        for policy in dict.fromkeys(r["policy"] for r in board if r["policy"] != "full"):
            cells = []
            for b in budgets:
                r = next((r for r in board if r["policy"] == policy and r["budget"] == b), None)
                if r is None:
                    cells += ["", ""]
                    continue
                gap = (h2o[b] - r["ppl"]) / (h2o[b] - full["ppl"]) if b in h2o and h2o[b] != full["ppl"] else None
                cells += [f"{r['ppl']:.2f} / {r['top1_agree_full']:.3f} / {r['kl_full']:.3f} / "
                          f"{r['kv_bytes'] / 2**20:.1f}", "" if gap is None or policy == "h2o" else f"{gap:+.0%}"]
            print(f"| {policy} | " + " | ".join(cells) + " |")
    for text in ("GPL-3", "GFDL-1.3"):
        points = [r for bits in (8, 4) for r in rows(f"quant{bits}_{text}.jsonl")]  # h2o, and full at 8 / 4 bits
        points += [r for r in rows(f"leaderboard_{text}.jsonl") if r["policy"] in ("h2o", "full")]
        points += [r for r in rows(f"quant32_{text}.jsonl") if r["policy"] == "h2o"]
        if not points:
            continue
        print(f"\n### h2o (and full) at equal KV bytes, {text}, 2048 tokens\n")
        print("| KV MiB | policy | bits | budget | C | ppl | top-1 | KL |")
        print("|---|---|---|---|---|---|---|---|")
        for r in sorted(points, key=lambda r: (r["kv_bytes"], -r["kv_bits"])):
            print(f"| {r['kv_bytes'] / 2**20:.2f} | {r['policy']} | {r['kv_bits']} | {r['budget'] or 'all'} | "
                  f"{r['capacity']} | {r['ppl']:.2f} | {r['top1_agree_full']:.3f} | {r['kl_full']:.3f} |")



def workbench():
    """The new policies of scripts/quality/run_workbench.sh beside h2o, with the share of h2o's gap to full they close."""
    for text in ("GPL-3", "GFDL-1.3"):
        board = rows(f"workbench_{text}.jsonl")
        if not board:
            continue
        full = next(r for r in board if r["spec"] == "full")
        h2o = {r["budget"]: r["ppl"] for r in board if r["spec"] == "h2o"}
        budgets = list(dict.fromkeys(r["budget"] for r in board if r["budget"]))
        print(f"\n### {text}, {full['tokens']} tokens (full: ppl {full['ppl']:.2f})\n")
        print("ppl / top-1 agreement with full / KL(full || policy); *gap*: the share of h2o's perplexity gap to "
              "full that the policy closes (negative: wider)\n")
        print("| policy | " + " | ".join(f"{b}: ppl / top-1 / KL | gap" for b in budgets) + " |")
        print("|---|" + "---|---|" * len(budgets))
        for spec in dict.fromkeys(r["spec"] for r in board if r["spec"] != "full"):
            cells = []
            for b in budgets:
                r = next(r for r in board if r["spec"] == spec and r["budget"] == b)
                gap = (h2o[b] - r["ppl"]) / (h2o[b] - full["ppl"])
                cells += [f"{r['ppl']:.2f} / {r['top1_agree_full']:.3f} / {r['kl_full']:.3f}",
                          "" if spec == "h2o" else f"{gap:+.0%}"]
            print(f"| {spec} | " + " | ".join(cells) + " |")


MODELS = {"default": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}


def models():
    """SmolLM2 against Gemma 3 (scripts/quality/run_two_models.sh): every policy's ppl and KV bytes, the needle, the bench."""
    for text in ("GPL-3", "GFDL-1.3"):
        boards = {m: rows(f"models_{m}_{text}.jsonl") for m in MODELS}
        if not any(boards.values()):
            continue
        have = {(r["policy"], r["budget"]) for r in boards["default"]}  # else section 1's rows at 4096 tokens
        boards["default"] += [r for r in rows(f"ablation_{text}.jsonl") if r["budget"] in (None, "0.1", "0.2")
                              and (r["policy"], r["budget"]) not in have]
        budgets = sorted({r["budget"] for b in boards.values() for r in b if r["budget"]}, key=float)
        print(f"\n### {text}, 4096 tokens: ppl / top-1 agreement with full / KV MiB\n")
        print("| policy | " + " | ".join(f"{MODELS[m]} {b or 'all'}" for m in MODELS for b in budgets) + " |")
        print("|---|" + "---|" * len(MODELS) * len(budgets))
        names = dict.fromkeys(r["policy"] for b in boards.values() for r in b)
        for policy in names:
            cells = []
            for m in MODELS:
                for b in budgets:
                    r = next((r for r in boards[m] if r["policy"] == policy and r["budget"] in (b, None)), None)
                    kv = f"{r['kv_bytes'] / 2**20:.1f}" if r and "kv_bytes" in r else "="  # older rows: as on GPL-3
                    cells.append("" if r is None else f"{r['ppl']:.2f} / {r['top1_agree_full']:.3f} / {kv}")
            print(f"| {policy} | " + " | ".join(cells) + " |")
    print("\n### Needle (found / depths 0.1, 0.5, 0.9; dense prefill)\n")
    lengths = (1024, 2048, 4096)
    print("| model | policy | budget | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|---|---|" + "---|" * len(lengths))
    for m in MODELS:
        cells = rows(f"models_needle_{m}.jsonl")
        for key in dict.fromkeys((c["policy"], c["budget"]) for c in cells):
            per = [[c["found"] for c in cells if (c["policy"], c["budget"]) == key and c["length"] == n] for n in lengths]
            print(f"| {MODELS[m]} | {key[0]} | {key[1] or 'all'} | " + " | ".join(f"{sum(f)}/{len(f)}" for f in per) + " |")
    bench = rows("models_bench_gemma3-270m.jsonl")
    if bench:
        print("\n### bench, Gemma 3 270M, batch 1, 32 new tokens\n")
        print("| policy | budget | prompt | C | KV MiB | prefill s | decode tok/s | peak MiB |")
        print("|---|---|---|---|---|---|---|---|")
        for r in bench:
            print(f"| {r['policy']} | {r['budget'] or 'all'} | {r['prompt_tokens']} | {r['capacity']} | "
                  f"{r['kv_bytes'] / 2**20:.1f} | {r['prefill_s']:.1f} | {r['decode_tok_s']:.2f} | "
                  f"{(r['peak_mem_bytes'] or 0) / 2**20:.0f} |")


def hindsight():
    """Every policy of sections 5 and 8 against h2o, full and hindsight at the same budget, and Gemma 3 270M's
    runs (scripts/quality/run_hindsight.sh)."""
    for text in ("GPL-3", "GFDL-1.3"):
        shares(f"{text}, 2048 tokens", ("0.05", "0.1", "0.2"),
               (f"leaderboard_{text}.jsonl", f"workbench_{text}.jsonl", f"hindsight_{text}.jsonl"))
    shares("Gemma 3 270M, GPL-3, 2048 tokens", ("0.1", "0.2"), ("hindsight_gemma3-270m_GPL-3.jsonl",))


def lookahead():
    """Section 12 (scripts/quality/run_lookahead.sh): the look-ahead rules against h2o and hindsight on two texts and two
    models, then their sampled generations beside section 11's rows of the same model."""
    for tag, label in (("", "SmolLM2-135M"), ("gemma3-270m_", "Gemma 3 270M")):
        for text in ("GPL-3", "GFDL-1.3"):
            shares(f"{label}, {text}, 2048 tokens", ("0.05", "0.1", "0.2"), (f"lookahead_{tag}{text}.jsonl",))
    for model in ("default", "gemma3-270m"):
        at = {(r.get("spec") or r["policy"], r["budget"]): r for name in (
            f"generate_sampled_{model}_512.jsonl", f"lookahead_generate_sampled_{model}_512.jsonl") for r in rows(name)}
        if ("expected_attention", "128") not in at:
            continue
        print(f"\n### {model}, sampled, N = 512: tokens before divergence / NLL of full's text / KL to full "
              f"(full: 512 / {at[('full', None)]['nll']:.3f})\n\n| policy | 128 | 256 |\n|---|---|---|")
        for p in dict.fromkeys(p for p, _ in at if p.split(":")[0] in (
                "h2o", "a2sf", "vatp", "tova", "expected_attention", "learned")):
            cells = [f"{r['agree_tokens']:.0f} / {r['nll']:.3f} / {r['kl_full']:.3g}" if (r := at.get((p, b))) else ""
                     for b in ("128", "256")]
            print(f"| {p.split(':')[0]} | " + " | ".join(cells) + " |")


def shares(title, budgets, files):
    """One table: each policy's perplexity, its share of h2o's gap to full and of hindsight's gain over h2o."""
    from h2o_mini.evals.sweep import share
    points = {}
    for name in files:
        # by spec (a2sf:gamma=0.9 is not a2sf); later files rerun the same rows
        points.update({(r.get("spec") or r["policy"], r["budget"]): r["ppl"] for r in rows(name)})
    if ("hindsight", "0.1") not in points:
        return
    full = points[("full", None)]
    print(f"\n### {title} (full: ppl {full:.2f})\n")
    head = " | ".join(f"{b}: ppl | of h2o's gap to full | of hindsight's gain over h2o" for b in budgets)
    print(f"| policy | {head} |")
    print("|---|" + "---|---|---|" * len(budgets))
    for policy in sorted(dict.fromkeys(p for p, b in points if p != "full"), key=lambda p: p == "hindsight"):
        cells = []
        for b in budgets:
            ppl, h2o = points.get((policy, b)), points.get(("h2o", b))
            if ppl is None:
                cells += ["", "", ""]
                continue
            cells += [f"{ppl:.2f}"] + [f"{v:+.0%}" if v is not None else "" for v in (
                share(ppl, h2o, full), share(ppl, h2o, points.get(("hindsight", b))))]
        print(f"| {policy.split(':weights=')[0]} | " + " | ".join(cells) + " |")  # learned: not its file's path


def generate():
    """eval generate on both models (scripts/quality/run_generate.sh): per policy and budget, the tokens written before the
    first divergence from full's text and the NLL of full's text read back; then each ranking beside the
    perplexity leaderboard's (section 9's sweep of the same model on GPL-3, 4096 tokens). Greedy texts
    (scripts/quality/run_generate.sh), then sampled ones (scripts/quality/run_generate_sampled.sh)."""
    for model, label in (("default", "SmolLM2-135M"), ("gemma3-270m", "Gemma 3 270M")):
        for kind, n in (("greedy", 512), ("greedy", 1024), ("sampled", 512)):
            board = rows(f"generate_{model}_{n}.jsonl" if kind == "greedy" else f"generate_sampled_{model}_{n}.jsonl")
            if not any(r["policy"] != "full" for r in board):  # not measured (or only full's row so far)
                continue
            how = board[0].get("sampling")
            title = label if how is None else f"{label}, sampled (temperature {how['temperature']:g}, " \
                f"seed {how['seed']})"
            at = {(r["policy"], r["budget"]): r for r in board}
            budgets = [b for b in ("64", "128", "256", "0.1", "0.2") if any(k[1] == b for k in at)]
            full = at[("full", None)]
            print(f"\n### {title}, N = {n}, the built-in prompts (means over {full['prompts']}): tokens before "
                  f"divergence / NLL of full's text (full: {n} / {full['nll']:.3f})\n")
            print("| policy | " + " | ".join(budgets) + " |")
            print("|---|" + "---|" * len(budgets))
            policies = sorted({p for p, _ in at if p != "full"},
                              key=lambda p: -sum(at[(p, b)]["agree_tokens"] for b in budgets if (p, b) in at))
            for p in policies:
                cells = [f"{at[(p, b)]['agree_tokens']:.0f} / {at[(p, b)]['nll']:.3f}" if (p, b) in at else ""
                         for b in budgets]
                print(f"| {p} | " + " | ".join(cells) + " |")
            if "128" in budgets and "256" in budgets:  # where each breaks, prompt by prompt
                print("\nPer prompt, tokens before divergence at 128 / 256 tokens:\n")
                names = ["story", "animals", "counting", "licence"] if full["prompt_set"] == "builtin" else []
                names += [f"prompt {i + 1}" for i in range(len(names), full["prompts"])]
                print("| policy | " + " | ".join(names) + " |")
                print("|---|" + "---|" * len(names))
                for p in (p for p in policies if (p, "128") in at and (p, "256") in at):
                    print(f"| {p} | " + " | ".join(f"{a['agree_tokens']} / {b['agree_tokens']}" for a, b in zip(
                        at[(p, "128")]["per_prompt"], at[(p, "256")]["per_prompt"])) + " |")
            mib = {b: at[(policies[0], b)]["kv_bytes"] / 2**20 for b in budgets if (policies[0], b) in at}
            print("\nKV MiB per budget: " + ", ".join(f"{b}: {v:.1f}" for b, v in mib.items())
                  + f" (full: {full['kv_bytes_full'] / 2**20:.1f})")
            ppl = {(r["policy"], r["budget"]): r["ppl"] for r in rows(f"models_{model}_GPL-3.jsonl")}
            for b in ("0.1", "0.2"):
                common = [p for p in policies if (p, b) in at and (p, b) in ppl]
                if len(common) < 3:
                    continue
                div, nll = {p: -at[(p, b)]["agree_tokens"] for p in common}, {p: at[(p, b)]["nll"] for p in common}
                per = {p: ppl[(p, b)] for p in common}
                print(f"\nAt {b}, Spearman's rho over {len(common)} policies: divergence vs perplexity "
                      f"{spearman(div, per):+.2f}, NLL of full's text vs perplexity {spearman(nll, per):+.2f}, "
                      f"divergence vs NLL {spearman(div, nll):+.2f}")
            if how is not None:  # sampled: token budgets only, so against perplexity at 0.1 and the greedy run
                greedy = {(r["policy"], r["budget"]): r for r in rows(f"generate_{model}_{n}.jsonl")}
                for b in budgets:
                    common = [p for p in policies if (p, b) in at and (p, b) in greedy and (p, "0.1") in ppl]
                    if len(common) < 3:
                        continue
                    div = {p: -at[(p, b)]["agree_tokens"] for p in common}
                    print(f"\nAt {b}, Spearman's rho over {len(common)} policies: divergence vs greedy divergence "
                          f"{spearman(div, {p: -greedy[(p, b)]['agree_tokens'] for p in common}):+.2f}, vs "
                          f"perplexity at 0.1 {spearman(div, {p: ppl[(p, '0.1')] for p in common}):+.2f}")
        consistent(model)


def spearman(a: dict, b: dict) -> float:
    """Spearman's rho of two scores over the same keys: Pearson's r of their ranks, tied scores sharing their mean
    rank (greedy divergences tie often: four policies that leave a text at the same token)."""
    def ranks(d):
        order = sorted(d, key=d.get)
        out = {}
        for k in order:
            same = [i for i, j in enumerate(order) if d[j] == d[k]]
            out[k] = sum(same) / len(same)
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra.values()) / len(ra), sum(rb.values()) / len(rb)
    cov = sum((ra[k] - ma) * (rb[k] - mb) for k in a)
    return cov / (sum((v - ma) ** 2 for v in ra.values()) * sum((v - mb) ** 2 for v in rb.values())) ** 0.5


def consistent(model: str) -> None:
    """A token budget fixes every row's cache whatever N is, so a prompt that leaves full's text within the first
    512 tokens must leave it at the same token in the N = 1024 run (a check that both runs are the same exact
    computation, batched differently)."""
    short = {(r["policy"], r["budget"]): r for r in rows(f"generate_{model}_512.jsonl")}
    pairs = [(a["agree_tokens"], b["agree_tokens"]) for r in rows(f"generate_{model}_1024.jsonl")
             if (r["policy"], r["budget"]) in short and r["budget"] not in ("0.1", "0.2")
             for a, b in zip(short[(r["policy"], r["budget"])]["per_prompt"], r["per_prompt"])
             if a["agree_tokens"] < 512]
    if pairs:
        print(f"\nN = 512 against N = 1024 ({model}, token budgets): {sum(a == b for a, b in pairs)} of {len(pairs)} "
              "prompts that leave full's text within 512 tokens leave it at the same token in both runs")


MODES = {"generate": generate, "hindsight": hindsight, "lookahead": lookahead, "models": models,
         "leaderboard": leaderboard, "workbench": workbench}
for mode in sys.argv[2:]:  # one of these prints its tables only; without one, the tables of run_results.sh
    MODES[mode]()
if sys.argv[2:]:
    sys.exit()

for text in ("GPL-3", "GFDL-1.3"):
    print(f"\n### {text}, 4096 tokens\n")
    print("| policy | budget | C | ppl | top-1 agree | KL vs full |")
    print("|---|---|---|---|---|---|")
    for r in rows(f"ablation_{text}.jsonl"):
        print(f"| {r['policy']} | {r['budget'] or 'all'} | {r['capacity']} | {r['ppl']:.2f} | "
              f"{r['top1_agree_full']:.3f} | {r['kl_full']:.3f} |")

print("\n### Attention power law\n")
print("| layer | tokens | top-20% share | max | median |")
print("|---|---|---|---|---|")
for r in rows("attention.jsonl"):
    print(f"| {r['layer']} | {r['tokens']} | {r['top20_share']:.3f} | {r['max']:.1f} | {r['median']:.2f} |")

for prefill in ("dense", "stream", "snapkv"):  # needle_snapkv: scripts/quality/run_leaderboard.sh (dense)
    cells = rows(f"needle_{prefill}.jsonl")
    if not cells:
        continue
    lengths = sorted({c["length"] for c in cells})
    print(f"\n### Needle, prefill {prefill} (found / cells; depths {sorted({c['depth'] for c in cells})})\n")
    print("| policy | budget | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for key in dict.fromkeys((c["policy"], c["budget"]) for c in cells):
        mine = [c for c in cells if (c["policy"], c["budget"]) == key]
        per = [[c["found"] for c in mine if c["length"] == n] for n in lengths]
        print(f"| {key[0]} | {key[1] or 'all'} | " + " | ".join(f"{sum(f)}/{len(f)}" for f in per) + " |")

print("\n### lm-eval: gpl_next_sentence\n")
print("| policy | budget | acc | acc_norm |")
print("|---|---|---|---|")
for r in rows("tasks.jsonl"):
    res = r["results"]["gpl_next_sentence"]
    print(f"| {r['policy']} | {r['budget'] or 'all'} | {res['acc,none']:.3f} | {res['acc_norm,none']:.3f} |")

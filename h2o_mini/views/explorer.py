"""`h2o-mini explore`: one self-contained HTML page of what each policy keeps, step by step, on real text.

The data comes from `record.record` (the real cache, every token through the rule) and is written into
the page as one JSON object: the text's tokens, and for each policy the step at which every position left
every layer and KV head (int32), and the cached tokens' scores at a few snapshot steps (float32, base64).
The page (`explore.html`, inline CSS and JavaScript, no network) draws the text like prose and colours it.

Size rule: per policy, 4 bytes x n_layer x n_kv_head x (T + C x snapshots), times 4/3 for base64. The
default model (30 layers, 3 KV heads) at 1024 tokens, C = 205 and 12 snapshots: about 1.3 MB a policy.
"""
from __future__ import annotations

import base64
import html
import json
from importlib.resources import files

import numpy as np

from .record import Recording


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).astype("<" + array.dtype.str[1:]).tobytes()).decode("ascii")


def window_of(policy) -> int:
    """The protected recent window a policy keeps (its `recent` or `window` parameter), 0 if none."""
    params = policy.params()
    return int(params.get("recent", params.get("window", 0)) or 0)


def page_data(model_name: str, source: str, tokens: list[str], recordings: dict[str, Recording], budget,
              full_nll: float) -> dict:
    """Everything the page shows, as one JSON-able object."""
    first = next(iter(recordings.values()))
    L, H, T = first.evicted_at.shape
    policies = []
    for label, rec in recordings.items():
        counts = [[int(s.shape[1]) for s in snap] for snap in rec.scores]  # cached tokens per snapshot and layer
        flat = np.concatenate([s.numpy().reshape(-1) for snap in rec.scores for s in snap] or [np.zeros(0)])
        policies.append({"label": label, "name": rec.policy.name, "params": rec.policy.params(),
                         "window": window_of(rec.policy), "capacities": rec.capacities, "kv_bytes": rec.kv_bytes,
                         "nll": rec.nll, "steps": rec.steps, "counts": counts,
                         "evicted": _b64(rec.evicted_at.numpy().astype(np.int32)),
                         "scores": _b64(flat.astype(np.float32))})
    return {"model": model_name, "source": source, "tokens": tokens, "n_layer": L, "n_kv_head": H, "T": T,
            "budget": None if budget is None else str(budget), "full_nll": full_nll, "policies": policies}


def render(data: dict) -> str:
    """The page: the template with the data inlined (`</` escaped so the text cannot end the script)."""
    template = files("h2o_mini.views").joinpath("explore.html").read_text(encoding="utf-8")
    payload = json.dumps(data, allow_nan=False).replace("</", "<\\/")
    title = html.escape(f"{data['model']}: what {', '.join(p['label'] for p in data['policies'])} keep")
    return template.replace("__TITLE__", title).replace("__DATA__", payload)

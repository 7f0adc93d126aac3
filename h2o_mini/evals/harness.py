"""lm-evaluation-harness tasks under any eviction policy (`h2o-mini eval tasks`), through the real harness.

`PolicyLM` is an `lm_eval` model (a `TemplateLM`, itself an `lm_eval.api.model.LM`): the harness builds the
requests (few-shot contexts, choices) and computes the metrics; this class only answers them with h2o-mini
under a policy, the way the H2O paper evaluated (Zhang et al., 2023, Sec. 5). Under `full` it answers what
lm-eval's own `hf` backend answers on the same weights (docs/evaluation.md says how, tests/test_lm_eval_parity.py
checks it): the same tokens, the same truncation, the same seeds, the same generation stops.

* `loglikelihood`: context + continuation are scored teacher-forced in stream mode, so eviction happens
  inside the few-shot context exactly as the spec's evaluation rule says (every token through the rule).
* `loglikelihood_rolling`: lm-eval's rolling windows of the model's length, each scored the same way.
* `generate_until`: h2o-mini's generation loop (greedy), cut at the request's stop strings and the end token.

A fractional budget is taken of each request's own length (the paper's convention); a token count is used
as is. Requests are batched (left-padded rows) among those that get the same policy.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from ..api import LM
from ..errors import UserError
from ..generate import Decoder
from ..policies import make_policy
from ..policies.base import refuse_lookahead
from .ppl import read_logits


class PolicyLM(TemplateLM):
    def __init__(self, lm: LM, policy: str = "full", budget=None, recent=None, prefill: str = "dense",
                 batch_size: int = 8, chunk: int = 256, compile: bool = False, progress: bool = True,
                 kv_bits: int | None = None):
        super().__init__()
        self.quiet = not progress
        self.lm, self.policy, self.budget, self.recent, self.prefill = lm, policy, budget, recent, prefill
        self.batch_size = batch_size
        self.decoder = Decoder(lm.model, compile=compile, chunk=chunk, kv_bits=kv_bits)
        refuse_lookahead(make_policy(policy, budget, 1000, recent))  # a bad policy fails here, before any request
        self.kv_bytes = 0  # the largest cache one request has held (one row)

    def policy_for(self, length: int):
        policy = make_policy(self.policy, self.budget, length, self.recent, quiet=True)
        self.kv_bytes = max(self.kv_bytes, self.decoder.cache_bytes(policy, 1, length))
        return policy

    # -- what TemplateLM needs to tokenize as the hf backend does --
    @property
    def tokenizer_eos(self) -> int | None:
        """The tokenizer's own end token, the one the hf backend uses (None: it has none)."""
        return self.lm.tokenizer.token_id(self.lm.tokenizer.special.get("eos_token"))

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end token, else the config's first."""
        eos = self.tokenizer_eos
        return eos if eos is not None else (self.lm.eos_ids or (0,))[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.lm.tokenizer.token_id(self.lm.tokenizer.special.get("bos_token"))
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.lm.model.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        bos = self.lm.tokenizer.special.get("bos_token")
        special = add_special_tokens if add_special_tokens is not None else not (bos and string.startswith(bos))
        return self.lm.tokenizer.encode(string, special=special)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.lm.tokenizer.decode(tokens)

    # -- the three request types --
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context_enc, continuation_enc). The model reads the last
        max_length + 1 tokens less the final one, as lm-eval's hf backend does."""
        rows = []
        for _, ctx, cont in requests:
            seq = (ctx + cont)[-(self.max_length + 1):]
            rows.append((seq[:-1], seq[-len(cont):]))
        groups = defaultdict(list)  # one policy per batch: same C for every row
        for i, (inp, _) in enumerate(rows):
            groups[self.policy_for(len(inp))].append(i)
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        bar = tqdm(total=len(rows), desc=f"loglikelihood ({self.policy})", disable=disable_tqdm or self.quiet or None)
        for policy, members in groups.items():
            members.sort(key=lambda i: -len(rows[i][0]))
            for b in range(0, len(members), self.batch_size):
                batch = members[b:b + self.batch_size]
                for i, result in zip(batch, self._score(policy, [rows[i] for i in batch])):
                    out[i] = result
                bar.update(len(batch))
        bar.close()
        return out

    @torch.inference_mode()
    def _score(self, policy, rows) -> list[tuple[float, bool]]:
        """Sum of log p(continuation) and whether greedy decoding gives it, for left-padded rows."""
        T = max(len(inp) for inp, _ in rows)
        tail = max(len(cont) for _, cont in rows)  # only the last `tail` positions are ever needed
        parts = [logits[:, max(0, T - tail - s):].log_softmax(-1)
                 for s, logits in read_logits(self.decoder, policy, [inp for inp, _ in rows])
                 if s + logits.shape[1] > T - tail]
        logprobs = torch.cat(parts, 1)[:, -tail:]  # (B, tail, V)
        results = []
        for r, (_, cont) in enumerate(rows):
            lp = logprobs[r, tail - len(cont):]  # (len(cont), V)
            target = torch.tensor(cont, device=lp.device)
            results.append((lp.gather(1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in tqdm([r.args for r in requests], desc="rolling", disable=disable_tqdm or self.quiet or None):
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            out.append(sum(lp for lp, _ in scores))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """As the hf backend: the context left-truncated to max_length - max_gen_toks, greedy tokens up to the
        end token or max_gen_toks, the text cut at the first of the stop strings (lm-eval adds the end token's
        text to them)."""
        out = []
        # the tokenizer's end token as text is a stop string too (the hf backend's rule); a tokenizer without one
        # adds none (the hf backend has no end token to decode there, and a config's id may be any byte)
        eos_id = self.tokenizer_eos
        eos = None if eos_id is None else self.lm.tokenizer.decode([eos_id], skip_special=False)
        bar = tqdm([r.args for r in requests], desc="generate", disable=disable_tqdm or self.quiet or None)
        for context, gen_kwargs in bar:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), 256)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise UserError("eval tasks generates greedily; a task asked for sampling")
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]
            policy = self.policy_for(len(ids) + max_new)
            tokens = []
            for t in self.decoder.complete(ids, policy, max_new, self.prefill, self.lm.eos_ids):
                tokens.append(t)
                if any(stop and stop in self.tok_decode(tokens) for stop in until):
                    break
            out.append(postprocess_generated_text(self.tok_decode(tokens), until, None))
        return out


SHIPPED_TASKS = Path(__file__).with_name("tasks")  # gpl_next_sentence: an offline example task
LM_EVAL_SEEDS = (0, 1234, 1234, 1234)  # lm_eval's --seed default (random, numpy, torch, few-shot sampler)


def run_tasks(lm: LM, tasks: list[str], include_path: str | None = None, num_fewshot: int | None = None,
              limit: int | None = None, batch_size: int = 8, policy: str = "full", budget=None, recent=None,
              prefill: str = "dense", log_samples: bool = False, compile: bool = False,
              progress: bool = True, kv_bits: int | None = None, seed: tuple = LM_EVAL_SEEDS) -> dict:
    """`lm_eval.simple_evaluate` with h2o-mini under a policy; the shipped tasks are always available.
    Returns lm-eval's results, plus "kv": the stored bits of keys and values and the largest cache one
    request held (bytes). seed: python's, numpy's, torch's and the few-shot sampler's seeds, lm-eval's own
    defaults unless given (the few-shot examples, and so every number, depend on the last one)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local data only: no hub at run time
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    paths = [str(SHIPPED_TASKS)] + ([include_path] if include_path else [])
    if include_path and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path} is not a folder")
    model = PolicyLM(lm, policy, budget, recent, prefill, batch_size, compile=compile, progress=progress,
                     kv_bits=kv_bits)
    with quiet_harness():
        manager = _task_manager(tasks, paths)
        results = simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, log_samples=log_samples, batch_size=batch_size,
                                  random_seed=seed[0], numpy_random_seed=seed[1], torch_random_seed=seed[2],
                                  fewshot_random_seed=seed[3])
    return dict(results, kv={"kv_bits": model.decoder.stored_bits, "kv_bytes": model.kv_bytes})


def _task_manager(tasks: list[str], paths: list[str]):
    """lm-eval's TaskManager over its own tasks and `paths`, with every task checked to load (a UserError if not)."""
    from lm_eval.tasks import TaskManager, get_task_dict
    try:
        manager = TaskManager(include_path=paths)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise UserError(f"unknown task {unknown[0]!r} (not registered in lm-eval nor in {', '.join(paths)})")
        get_task_dict(tasks, manager)  # a malformed task folder fails here, with its own message
    except UserError:
        raise
    except Exception as e:  # yaml, datasets and lm-eval raise many kinds; each is a bad task folder here
        raise UserError(f"cannot load the tasks {','.join(tasks)}: {type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0]}") from None
    return manager


@contextlib.contextmanager
def quiet_harness():
    """While lm-eval runs: none of its warnings meant for its own command line (a `--metadata` hint for an
    option h2o-mini has none of), and none of the environment report that h2o-mini does not show (`git
    describe` in the user's folder, whose "fatal: not a git repository" lands on stderr, and torch's
    collect_env, which runs a dozen programs). All restored afterwards."""
    import lm_eval.evaluator as evaluator
    log = logging.getLogger("lm_eval")
    saved = log.level, evaluator.get_git_commit_hash, evaluator.add_env_info
    log.setLevel(logging.ERROR)
    evaluator.get_git_commit_hash, evaluator.add_env_info = (lambda: None), (lambda storage: None)
    try:
        yield
    finally:
        log.setLevel(saved[0])
        evaluator.get_git_commit_hash, evaluator.add_env_info = saved[1:]

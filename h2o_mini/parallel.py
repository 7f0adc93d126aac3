"""Tensor parallelism through torch.distributed: every rank holds and evicts only its own KV heads.

Megatron-LM's split (Shoeybi et al., 2019, arXiv 1909.08053) applied per GQA group: over N ranks, rank r
keeps KV heads [r n_kv/N, (r+1) n_kv/N) with all their query heads (the rows of wq, wk, wv and the columns of
wo that belong to them) and 1/N of the MLP width (rows of the gate/up projections, columns of the down
projection). Each block then needs two all-reduces, after the attention output projection and after the MLP;
nothing else is sent. H2O's rule is per KV head (scores sum the query heads of one group, which live on
the same rank), so each rank's `KVCache` holds C slots for its own heads and evicts them with no
communication at all. Embeddings, norms and the vocabulary projection are replicated: every rank computes
the same logits and samples the same token, so nothing is broadcast per step.

Started by torchrun (`WORLD_SIZE` > 1): `from_env` joins the process group (gloo on CPU, NCCL on CUDA).
Each rank reads only its shard of every tensor from the safetensors files (`weights/hf.py` calls `take`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .config import Config
from .errors import UserError

# model parameter name suffix -> the dimension split across ranks (wo's and w_down's biases: on rank 0 only)
_SPLIT = {"attn.wq.weight": 0, "attn.wq.bias": 0, "attn.wk.weight": 0, "attn.wk.bias": 0, "attn.wv.weight": 0,
          "attn.wv.bias": 0, "attn.wo.weight": 1, "mlp.w_gate.weight": 0, "mlp.w_gate.bias": 0,
          "mlp.w_up.weight": 0, "mlp.w_up.bias": 0, "mlp.w_down.weight": 1}
_ONCE = ("attn.wo.bias", "mlp.w_down.bias")


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group of `size` ranks."""

    rank: int
    size: int

    def local_config(self, cfg: Config) -> Config:
        """The config of this rank's slice: 1/N of the heads and of the MLP width (a UserError if they do not
        split evenly)."""
        n = self.size
        if cfg.n_kv_head < n:  # Gemma 3 270M has a single KV head: there is nothing to split the cache by
            raise UserError(f"tensor parallel over {n} ranks splits the KV heads, and this model has only "
                            f"{cfg.n_kv_head} (fewer than the ranks): run it in one process")
        if cfg.n_kv_head % n or cfg.n_head % n or cfg.d_ff % n:
            raise UserError(f"tensor parallel over {n} ranks needs the model's {cfg.n_kv_head} KV heads, {cfg.n_head} "
                            f"query heads and MLP width {cfg.d_ff} to divide by {n}")
        return replace(cfg, n_head=cfg.n_head // n, n_kv_head=cfg.n_kv_head // n, d_ff=cfg.d_ff // n)

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor for model parameter `name` (a copy: the full one can go)."""
        for suffix, dim in _SPLIT.items():
            if name.endswith(suffix):
                return tensor.chunk(self.size, dim)[self.rank].clone()
        if name.endswith(_ONCE):  # added once to the sum over ranks
            return tensor.clone() if self.rank == 0 else torch.zeros_like(tensor)
        return tensor

    def device(self, device: str) -> str:
        """`cuda` means this rank's own GPU (torchrun's LOCAL_RANK); naming one GPU for every rank is refused."""
        if device.startswith("cuda:"):
            raise UserError(f"under torchrun --device cuda means each rank's own GPU; {device} would put every "
                            "rank on one")
        if device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return f"cuda:{local}"
        return device


def from_env(device: str = "cpu") -> Shard | None:
    """This process's shard when torchrun started it with WORLD_SIZE > 1 (joining the process group: NCCL for
    a CUDA `device`, gloo on CPU), else None."""
    if not launched():
        return None
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
        except (RuntimeError, ValueError) as e:
            raise UserError(f"cannot join the torchrun process group: {str(e).splitlines()[0]}") from None
    return Shard(dist.get_rank(), dist.get_world_size())


def all_reduce(x: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """The sum of every rank's partial output (a no-op on one process). A functional collective, so that the
    compiled decode step can trace it."""
    if shard is None:
        return x
    from torch.distributed import _functional_collectives as fc
    return fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))


def gather(value, shard: Shard | None) -> list:
    """Every rank's `value` (a small Python object), in rank order; [value] on one process."""
    if shard is None:
        return [value]
    out = [None] * shard.size
    dist.all_gather_object(out, value)
    return out


def from_rank0(value, shard: Shard | None):
    """Rank 0's `value` (a small Python object) on every rank; `value` itself on one process."""
    if shard is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def common_seed(seed: int | None, shard: Shard | None) -> int | None:
    """Sampling must draw the same noise on every rank: without a seed, rank 0 picks one for all."""
    if shard is None or seed is not None:
        return seed
    box = [int(torch.randint(0, 2**62, (1,)))]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def launched() -> bool:
    """Whether torchrun started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def is_main() -> bool:
    """Whether this process is rank 0 (or the only one): the one that prints and writes files."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def refuse(command: str) -> None:
    """Commands other than generate, eval ppl and bench would run whole on every rank: refused under torchrun."""
    if launched():
        raise UserError(f"'{command}' does not run tensor parallel; under torchrun use generate, eval ppl or bench")


def _quiet() -> bool:
    """A rank other than 0 under torchrun: it prints nothing (`quiet_other_ranks`)."""
    return launched() and not is_main()


def quiet_other_ranks() -> None:
    """Under torchrun only rank 0 prints (results, progress, errors): the others write to /dev/null. A rank
    that fails still exits non-zero, and torchrun reports it."""
    if _quiet():
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)


def before_failing() -> None:
    """A quiet rank about to exit on an error waits: torchrun stops every rank as soon as one exits, and rank 0,
    meeting the same error (a refusal, bad input) at the same point, must have time to print it."""
    if _quiet():
        time.sleep(2.0)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def kv_bytes(model, local: int) -> dict:
    """What the JSON outputs report of a cache: its bytes over all ranks, each rank's, and the world size."""
    per_rank = gather(local, model.shard)
    return {"kv_bytes": sum(per_rank), "kv_bytes_per_rank": per_rank, "world_size": len(per_rank)}

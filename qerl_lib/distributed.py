"""Several processes and GPUs: where each part of a run goes, and the data-parallel LoRA update.

Placement (`placement`) is pure: from `ParallelConfig`, the number of GPUs and the model's
config it returns the GPU ids of the rollout engine (one group of `rollout_tensor_parallel`
GPUs) and of every trainer rank, or a ValueError that says what does not fit.

The update (`DistContext`, `shard`, `all_reduce_grads`, `all_reduce_sums`) is plain data
parallelism over the LoRA parameters, without DDP's bucketing (a LoRA has few, small tensors):
every rank reads all rows of the step and builds the same micro-batches and the same loss
normalisers, runs the forward and backward of its own micro-batches (every world_size-th one),
then the gradients are summed over ranks, so every rank steps the same optimizer on the same
gradient and holds the same adapter; rank 0 writes it. Ranks with no micro-batch in a
mini-batch contribute zeros.

`run_update_group` starts the ranks on this machine (torch.multiprocessing, gloo on CPU, NCCL
on CUDA with one GPU per rank); under `torchrun` (WORLD_SIZE in the environment, any number of
machines) the update stage joins that group instead.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from qerl_lib.config import ParallelConfig


MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off in NCCL, PyTorch and NVSHMEM for every multi-GPU process we start: on
shared hosts a program using it can take the GPUs out of service (the lent machines' rule)."""


def multicast_off() -> None:
    """Set `MULTICAST_OFF` in this process's environment (children inherit it); values set by the user win."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)


# ============================================================================ placement


def check_tensor_parallel(model_config: dict, tp: int) -> None:
    """ValueError unless vLLM can split this Llama/Qwen2 config over `tp` GPUs."""
    heads = int(model_config["num_attention_heads"])
    kv = int(model_config.get("num_key_value_heads", heads))
    if heads % tp:
        raise ValueError(f"parallel.rollout_tensor_parallel={tp}: {heads} attention heads do not divide by it")
    if kv % tp and tp % kv:
        raise ValueError(f"parallel.rollout_tensor_parallel={tp}: {kv} KV heads neither divide by it nor divide it")


def placement(par: ParallelConfig, n_gpus: int, model_config: dict | None = None) -> dict[str, Any]:
    """GPU ids of each rollout replica and of each trainer rank.

    Returns {"rollout": [[gpu, ...] per replica], "train": [gpu per rank], "gpus_used": n}.
    Replica r takes GPUs r*T .. r*T+T-1 (T = `rollout_tensor_parallel`). With `colocate` the
    trainer also starts at GPU 0 (the engines sleep while it runs); without, it takes the GPUs
    after the engines'. `n_gpus` 0 (CPU) allows only the trainer, whose ranks then have no GPU
    (None).
    """
    tp, reps, world = par.rollout_tensor_parallel, par.rollout_replicas, par.train_world_size
    if model_config is not None:
        check_tensor_parallel(model_config, tp)
    if n_gpus == 0:
        if tp > 1 or reps > 1:
            raise ValueError(f"parallel: {reps} rollout replica(s) of tensor parallel {tp} need GPUs; none found")
        return {"rollout": [], "train": [None] * world, "gpus_used": 0}
    engines = tp * reps
    rollout = [list(range(r * tp, (r + 1) * tp)) for r in range(reps)]
    first = 0 if par.colocate else engines
    train = list(range(first, first + world))
    used = max(engines, world) if par.colocate else engines + world
    if used > n_gpus:
        how = "max(rollout_tensor_parallel * rollout_replicas, train_world_size)" if par.colocate else \
            "rollout_tensor_parallel * rollout_replicas + train_world_size"
        raise ValueError(f"parallel: {how} = {used} GPUs, but {n_gpus} are visible")
    return {"rollout": rollout, "train": train, "gpus_used": used}


# ============================================================================ the data-parallel update


@dataclass(frozen=True)
class DistContext:
    """This process's place in the update group."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def shard(items: Sequence, ctx: DistContext | None) -> list[tuple[int, Any]]:
    """(index, item) of the items this rank runs: every world_size-th, starting at its rank."""
    if ctx is None or ctx.world_size == 1:
        return list(enumerate(items))
    return [(i, x) for i, x in enumerate(items) if i % ctx.world_size == ctx.rank]


def all_reduce_grads(params: list[torch.nn.Parameter], ctx: DistContext | None) -> None:
    """Sum every parameter's gradient over the group, in place (a missing gradient counts as 0).

    Flattened into one buffer: one collective per optimizer step instead of one per tensor.
    """
    if ctx is None or ctx.world_size == 1:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1).float() for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad).to(p.grad.dtype))
        offset += n


def all_reduce_sums(values: dict[str, float], ctx: DistContext | None) -> dict[str, float]:
    """The sums over the group of per-rank float sums (same keys on every rank: missing ones count 0)."""
    if ctx is None or ctx.world_size == 1:
        return dict(values)
    import torch.distributed as dist

    keys: list[list[str]] = [None] * ctx.world_size  # type: ignore[list-item]
    dist.all_gather_object(keys, sorted(values))
    union = sorted(set().union(*keys))
    t = torch.tensor([float(values.get(k, 0.0)) for k in union], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(union, t.tolist()))


def context_from_env() -> DistContext | None:
    """The group this process was started in (`torchrun` or `run_update_group`), initialised; None if none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available() and os.environ.get("QERL_DIST_BACKEND", "") != "gloo"
    multicast_off()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return DistContext(rank, world, device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    try:
        fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_update_group(world: int, fn: Callable, *args) -> None:
    """Run `fn(*args)` in `world` new local processes forming one group (each reads its place
    with `context_from_env`). Raises if any rank fails. `fn` must be importable (module level)."""
    import torch.multiprocessing as mp

    multicast_off()
    mp.start_processes(_rank_main, args=(world, free_port(), fn, args), nprocs=world, join=True,
                       start_method="spawn")

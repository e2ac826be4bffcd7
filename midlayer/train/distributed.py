"""One code path for 1 and N processes: read torchrun's environment, rank-0 printing.

`torchrun --nproc_per_node N -m midlayer train ...` sets RANK / LOCAL_RANK / WORLD_SIZE; a plain
`midlayer train ...` has none of them and runs as rank 0 of 1 without initialising a process group.
Backend: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(spec: str | None, flag: str = "--device") -> torch.device:
    """The torch device a `--device` value names, or a ValueError naming `flag` that says why it cannot be
    used here (not a device string; CUDA/MPS not available on this machine; no such CUDA index). None: cuda
    when available, else cpu. Call it before loading anything, so no load error is blamed on a file."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{flag} {spec!r}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"{flag} {spec}: CUDA is not available on this machine ({why}); use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"{flag} {spec}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{flag} {spec}: MPS is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise ValueError(f"{flag} {spec!r}: midlayer runs on cpu, cuda[:N] or mps, not {dev.type}")
    return dev


def setup(device: str | None = None) -> DistInfo:
    """Initialise the process group when launched by torchrun; pick this process's device."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank, local_rank, world, dev)


def teardown() -> None:
    """Destroy the process group, if one was made.

    On gloo, wait 0.1 s first. Why: the last all-reduce of DDP's reducer is completed, and its work object
    then released, on a gloo worker thread, which needs the GIL to do it. If the main thread gets from here
    to interpreter shutdown before that thread has run, the release happens during finalisation and the
    process aborts (SIGABRT after training had finished and saved; seen in CI, diagnosed under gdb by the
    21st session). Collecting the dead DDP wrapper here and yielding the GIL for a moment lets the worker
    finish first. `tests/test_train.py::test_ddp_two_gloo_processes_equal_single_process` is the guard.
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            gc.collect()
            time.sleep(0.1)
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (identity in a single process)."""
    if dist.is_available() and dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= dist.get_world_size()
    return x


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def print0(*args, **kwargs) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_max(n: int, device: torch.device) -> int:
    """The largest of every rank's `n` (n itself in a single process)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor(n, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())
    return n


# ------------------------------------------------------------------------------------------------ FSDP2
# `train --parallel fsdp`: each rank holds 1/N of every parameter, gradient and Adam moment between steps
# (FSDP2's `fully_shard`, a DTensor sharded on dim 0 per parameter); a block's full weights exist only while
# that block runs, gathered just before. Checkpoints hold full, unsharded tensors in the same layout as a
# plain model's `state_dict()` and `AdamW.state_dict()`, so a run may switch between 1 process, DDP and FSDP
# on resume. Every function below is a collective under FSDP: all ranks call it.


def shard_model(model: torch.nn.Module) -> None:
    """Shard `model` in place: one FSDP unit per block (gathered for that block's forward and backward only),
    then the root (embeddings, routers, final norm, head). Build the optimizer after this, on the sharded
    parameters."""
    from torch.distributed.fsdp import fully_shard

    # The model's output carries views (GateStats keeps the rows each router read, h[:, :routed], for the
    # regulariser's gradient); FSDP2 warns that an in-place op on one would skip its hook. Nothing writes to them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


def _flat_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter in the order `opt.state_dict()` numbers them (group by group)."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in opt.param_groups for p in g["params"]]


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) of a sharded model as full tensors on the CPU, laid out as the unsharded
    model's and optimizer's own `state_dict()` (parameters numbered in group order), on rank 0; other ranks
    get empty dicts. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts)
    if not msd:  # not rank 0
        return {}, {}
    index = {n: i for i, n in enumerate(_flat_names(model, opt))}
    state = {index[n]: s for n, s in osd["state"].items()}
    # the groups' settings as the optimizer itself writes them (numbered parameters, tuples kept)
    return msd, {"state": state, "param_groups": opt.state_dict()["param_groups"]}


def load_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a full optimizer state (the unsharded layout `full_state` writes) into the optimizer of a sharded
    model: every rank keeps its own shard of each moment. A collective: every rank calls it, with the state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _flat_names(model, opt)
    by_name = {"state": {names[int(i)]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, opt, by_name, options=StateDictOptions(full_state_dict=True))
    for group, saved in zip(opt.param_groups, state["param_groups"]):  # settings exactly as saved (betas a
        group.update({k: v for k, v in saved.items() if k != "params"})  # tuple, as load_state_dict keeps it)


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` (the same two steps, so the same bits on plain tensors) that also serves
    sharded parameters: the 2-norm of all gradients over every shard (a plain tensor, the same on every rank),
    and each gradient scaled by min(1, max_norm / (norm + 1e-6)). Over DTensor gradients torch's one call
    would return the norm as a DTensor; here the scale comes from its full value."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm

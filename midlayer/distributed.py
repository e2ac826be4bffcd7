"""One code path for 1 and N processes: read torchrun's environment, rank-0 printing.

`torchrun --nproc_per_node N -m midlayer train ...` sets RANK / LOCAL_RANK / WORLD_SIZE; a plain
`midlayer train ...` has none of them and runs as rank 0 of 1 without initialising a process group.
Backend: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import gc
import os
import time
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

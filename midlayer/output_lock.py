"""One writer per output (issue 43): the advisory lock that every command which writes a run holds on its
output -- `train` and `sweep` on their folder, `train-draft` / `train-gates` on each drafter's folder,
`distill` on its file -- for as long as it writes.

A second writer is refused with one line naming the holder's pid, before it writes anything. The lock is
`fcntl.flock` on a file beside the output (`DIR/.midlayer.lock`, or `FILE.lock`): the kernel drops it when
its process ends, however it ends, so a lock left by a killed run never blocks the next one; the pid
written in the file is only what the refusal names. Advisory: it binds midlayer's commands, not other
programs. On a system without `fcntl` (Windows) it does nothing.

`refuse_overwrite` is the other half: a results file (`--output`, `distill --out`) never takes the name of a
file that a run, a draft or a sweep keeps.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


class OutputBusy(ValueError):
    """Another midlayer process is writing this output."""


# The files a run, a draft or a sweep keeps (train, train-draft / train-gates, sweep): never a results file.
RUN_FILES = ("metrics.jsonl", "config.json", "eval.json", "draft.json", "draft.safetensors", "history.jsonl",
             "metrics.json", "train_state.pt", "sweep.json", ".midlayer.lock",
             "extrapolation.json", "throughput.json")  # (a run's, a sweep's: plot reads them back)


def refuse_overwrite(flag: str, path: str | Path) -> None:
    """Refuse (ValueError naming `flag`) a results file named as a checkpoint, or as a file that a run, a draft
    or a sweep keeps in a folder that holds one (`RUN_FILES`; issue 43: `eval RUN --output RUN/metrics.jsonl`
    replaced the training log)."""
    p = Path(path)
    if re.fullmatch(r"ckpt_\d+\.pt", p.name):
        raise ValueError(f"{flag} {path}: that is a checkpoint's name; the results would overwrite it")
    d = p.parent
    holds_run = any((d / n).exists() for n in ("config.json", "draft.json", "train_state.pt", "sweep.json",
                                               ".midlayer.lock")) or any(d.glob("ckpt_*.pt"))
    if p.name in RUN_FILES and holds_run:
        raise ValueError(f"{flag} {path}: {p.name} is a file of the run in {d}; the results would overwrite it, "
                         "so give another name")


def lock_path(target: Path, is_dir: bool) -> Path:
    return target / ".midlayer.lock" if is_dir else target.with_name(target.name + ".lock")


class OutputLock:
    """`with OutputLock(path, "train"):` -- hold the output `path` (a folder, created if missing, or a file
    with `is_dir=False`, whose folder is created) while the block runs; raises OutputBusy at entry when
    another process holds it."""

    def __init__(self, target: str | Path, command: str, is_dir: bool = True) -> None:
        self.target, self.command, self.is_dir = Path(target), command, is_dir
        self.path = lock_path(self.target, is_dir)
        self.fd: int | None = None

    def __enter__(self) -> "OutputLock":
        if fcntl is None:  # pragma: no cover
            return self
        (self.target if self.is_dir else self.target.parent).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").split()
            os.close(fd)
            who = f"pid {holder[0]}" if holder else "another process"
            raise OutputBusy(f"{self.target} is being written by another midlayer "
                             f"{holder[1] if len(holder) > 1 else 'command'} ({who}); wait for it to end, or "
                             "choose another output") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self.command}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


__all__ = ["OutputLock", "OutputBusy", "RUN_FILES", "lock_path", "refuse_overwrite"]

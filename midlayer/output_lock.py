"""One writer per output (issue 43): the advisory lock that every command which writes a run holds on its
output -- `train` and `sweep` on their folder, `train-draft` / `train-gates` on each drafter's folder,
`distill` on its file -- for as long as it writes.

A second writer is refused with one line naming the holder's pid, before it writes anything. The lock is
`fcntl.flock` on a file beside the output (`DIR/.midlayer.lock`, or `FILE.lock`): the kernel drops it when
its process ends, however it ends, so a lock left by a killed run never blocks the next one; the pid
written in the file is only what the refusal names. Advisory: it binds midlayer's commands, not other
programs. On a system without `fcntl` (Windows) it does nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


class OutputBusy(ValueError):
    """Another midlayer process is writing this output."""


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


__all__ = ["OutputLock", "OutputBusy", "lock_path"]

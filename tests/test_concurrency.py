"""One writer per output (issue 43, midlayer/output_lock.py): a second `train`, `train-draft`, `distill` or
`sweep` on an output another process is writing is refused with one line naming the holder's pid, exit 2,
nothing written; a lock left by a killed process does not block. Holders are real processes."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from midlayer.cli import main
from midlayer.output_lock import OutputBusy, OutputLock, lock_path

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _hold(target: Path, is_dir: bool = True, command: str = "train") -> subprocess.Popen:
    """A real process that holds the lock of `target` until killed; returns once it holds it."""
    code = ("import sys, time; from midlayer.output_lock import OutputLock\n"
            f"with OutputLock({str(target)!r}, {command!r}, is_dir={is_dir}):\n"
            "    print('held', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "held"
    return p


def _refused(capsys, argv: list[str], pid: int, root: Path) -> None:
    before = _snapshot(root)
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"pid {pid}" in lines[0] and "being written by another midlayer" in lines[0], err
    assert "Traceback" not in err and out == ""
    assert _snapshot(root) == before


def test_a_second_train_on_a_run_folder_is_refused_and_a_killed_holder_does_not_block(tmp_path, capsys):
    run = tmp_path / "run"
    holder = _hold(run)
    try:
        _refused(capsys, ["train", "debug", "--steps", "2", "--out-dir", str(run), "--no-progress"], holder.pid,
                 tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert str(holder.pid) in lock_path(run, True).read_text()  # the stale lock file stays ...
    assert main(["train", "debug", "--steps", "2", "--out-dir", str(run), "--no-progress"]) == 0  # ... and binds no one


def test_two_real_train_processes_on_one_folder(tmp_path):
    """Both started as users start them: the second exits 2 with one line while the first goes on."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "midlayer", "train", "debug", "--out-dir", str(run), "--no-progress"]
    first = subprocess.Popen([*cmd, "--steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             cwd=ROOT, env=env)
    try:
        deadline = time.time() + 120
        while not (lock_path(run, True).is_file() and lock_path(run, True).read_text().strip()):
            assert first.poll() is None and time.time() < deadline, "the first run never took its lock"
            time.sleep(0.2)
        second = subprocess.run([*cmd, "--steps", "2"], capture_output=True, text=True, cwd=ROOT, env=env,
                                timeout=120)
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0], second.stderr
        assert first.poll() is None  # the first run is untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_train_draft_distill_and_sweep_are_refused_while_held(tmp_path, capsys):
    draft = tmp_path / "draft"
    holder = _hold(draft, command="train-draft")
    try:
        _refused(capsys, ["train-draft", "--method", "medusa", "--out-dir", str(draft), "--data",
                          str(tmp_path / "none.jsonl"), "--no-progress"], holder.pid, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    sweep_root = tmp_path / "sweeps"
    holder = _hold(sweep_root / "smoke", command="sweep")
    try:
        _refused(capsys, ["sweep", "smoke", "--out-dir", str(sweep_root)], holder.pid, tmp_path)
    finally:
        holder.kill()
        holder.wait()


def test_distill_refuses_a_file_being_written(tmp_path):
    from test_distill import PROMPTS, make_model, CharTok

    from midlayer.speculative.distill import distill

    model = make_model()
    out = tmp_path / "d.jsonl"
    holder = _hold(out, is_dir=False, command="distill")
    try:
        with pytest.raises(OutputBusy, match=f"pid {holder.pid}"):
            distill(model, CharTok({0}), PROMPTS[:2], out, max_new_tokens=2, progress=False)
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    distill(model, CharTok({0}), PROMPTS[:2], out, max_new_tokens=2, progress=False)
    assert out.is_file()


def test_the_lock_is_released_on_exit_and_names_its_holder(tmp_path):
    with OutputLock(tmp_path / "x", "train") as lock:
        assert lock_path(tmp_path / "x", True).read_text().split() == [str(os.getpid()), "train"]
        assert lock.fd is not None
    with OutputLock(tmp_path / "x", "train"):  # re-entered after release
        pass

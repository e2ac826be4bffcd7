"""What the repository may hold (issue 44): no training state (`train_state.pt`) and no file over 25 MB is
tracked, so a clone downloads code, tests, docs and the drafts and data they need at their final size, never
a run's optimizer moments. CI runs this with the suite (skipped outside a git checkout)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 25 * 2**20


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_training_state_and_no_large_file_is_tracked():
    files = _tracked()
    states = [str(p.relative_to(ROOT)) for p in files if p.name == "train_state.pt"]
    assert not states, f"training states are never committed (git rm --cached them): {states}"
    big = [(str(p.relative_to(ROOT)), p.stat().st_size) for p in files if p.is_file() and p.stat().st_size > LIMIT]
    assert not big, f"tracked files over 25 MB: {big}"


def test_gitignore_keeps_states_and_locks_out():
    ignored = subprocess.run(["git", "check-ignore", "drafts/x/train_state.pt", "runs/a/.midlayer.lock",
                              "data/d.jsonl.lock"], cwd=ROOT, capture_output=True, text=True)
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert ignored.stdout.split() == ["drafts/x/train_state.pt", "runs/a/.midlayer.lock", "data/d.jsonl.lock"]

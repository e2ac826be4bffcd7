"""Kill tests (issue 43): `train`, draft training and distillation are SIGKILLed at 10 random points each, in
real subprocesses, and resumed; the final weights (or file) equal an uninterrupted run's bit for bit, and no
half-written file is ever loaded (every write is atomic or appended whole, and resuming rereads what is on
disk). The kill points are seeded, so a failure repeats."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KILLS = 10


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "MIDLAYER_CACHE": str(tmp_path / "cache")}


def _kill_and_resume(cmd_for, env: dict, seed: int, until_done) -> int:
    """Start cmd_for(i) KILLS times, each SIGKILLed after a seeded random delay (or left to finish), then once
    more to the end; returns how many starts were killed before finishing."""
    rng = random.Random(seed)
    killed = 0
    for i in range(KILLS):
        if until_done():
            break
        p = subprocess.Popen(cmd_for(i), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.3, 3.5))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            killed += 1
        p.wait()
    last = subprocess.run(cmd_for(KILLS), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-2000:]
    return killed


def _digest(state: dict) -> str:
    from midlayer.checkpoint import weights_digest

    return weights_digest(state)


def test_train_killed_ten_times_ends_as_an_uninterrupted_run(tmp_path):
    from midlayer.checkpoint import list_checkpoints, load_checkpoint
    from midlayer.data import write_shard

    toks = np.random.default_rng(0).integers(0, 512, 12_000)
    d = tmp_path / "shards"
    d.mkdir()
    write_shard(d / "syn_train_000.bin", toks[:9_000])
    write_shard(d / "syn_val_000.bin", toks[9_000:])
    env = _env(tmp_path)

    def cmd(out: Path, resume: bool) -> list[str]:
        return [sys.executable, "-m", "midlayer", "train", "debug", "--data", str(d / "*.bin"), "--steps", "40",
                "--ckpt-every", "3", "--no-progress", "--out-dir", str(out)] + (["--resume"] if resume else [])

    whole = tmp_path / "whole"
    subprocess.run(cmd(whole, False), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    cut = tmp_path / "cut"
    done = lambda: (cut / "eval.json").is_file()  # noqa: E731
    killed = _kill_and_resume(lambda i: cmd(cut, bool(list_checkpoints(cut))), env, 1, done)
    assert killed >= 3  # the run was really cut, several times
    a, b = load_checkpoint(list_checkpoints(whole)[-1]), load_checkpoint(list_checkpoints(cut)[-1])
    assert a["step"] == b["step"] == 40
    assert _digest(a["model"]) == _digest(b["model"])
    assert not [p for p in cut.iterdir() if ".tmp" in p.name]


DRAFT_SCRIPT = """
import sys
from test_draft_training import cfg, tiny_base, tiny_data
from midlayer.draft_training import train_drafts
from pathlib import Path
out = Path(sys.argv[1])
c = [cfg(out, m, epochs=60, ckpt_every=2) for m in ("medusa", "early-exit")]
train_drafts(c, tiny_base(), tiny_data(), progress=False, log=lambda s: None)
"""


def test_draft_training_killed_ten_times_ends_as_an_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file

    env = _env(tmp_path)
    script = tmp_path / "draft.py"
    script.write_text(DRAFT_SCRIPT)
    subprocess.run([sys.executable, str(script), str(tmp_path / "whole")], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=600)
    cut = tmp_path / "cut"
    done = lambda: all((cut / m / "draft.json").is_file() for m in ("medusa", "early-exit"))  # noqa: E731
    _kill_and_resume(lambda i: [sys.executable, str(script), str(cut)], env, 2, done)
    for m in ("medusa", "early-exit"):
        a = load_file(str(tmp_path / "whole" / m / "draft.safetensors"))
        b = load_file(str(cut / m / "draft.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


DISTILL_SCRIPT = """
import sys
from test_distill import PROMPTS, CharTok, make_model
from midlayer.distill import distill
distill(make_model(), CharTok({0}), PROMPTS * 1, sys.argv[1], max_new_tokens=40, batch_size=2, progress=False)
"""


def test_distill_killed_ten_times_writes_the_uninterrupted_file(tmp_path):
    env = _env(tmp_path)
    script = tmp_path / "distill.py"
    script.write_text(DISTILL_SCRIPT)
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    subprocess.run([sys.executable, str(script), str(whole)], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=600)
    _kill_and_resume(lambda i: [sys.executable, str(script), str(cut)], env, 3, lambda: False)
    assert hashlib.sha256(cut.read_bytes()).hexdigest() == hashlib.sha256(whole.read_bytes()).hexdigest()

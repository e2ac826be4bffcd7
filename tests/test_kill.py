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


@pytest.fixture(scope="module")
def startup_s() -> float:
    """How long a Python process takes to import torch and midlayer here (kill points are placed after it). Timed
    on the second of two runs: the first compiles the bytecode (a fresh clone has none), which the processes
    the tests kill then find ready; timing it would place every kill late, after most of a run's work."""
    cmd = [sys.executable, "-c", "import torch, midlayer.cli, midlayer.speculative.draft_training, "
                                 "midlayer.speculative.distill"]
    for _ in range(2):
        t = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return time.perf_counter() - t


def _timed(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - t


def _kill_and_resume(cmd_for, env: dict, seed: int, until_done, whole_s: float, startup_s: float) -> int:
    """Start cmd_for(i) KILLS times, each SIGKILLed at a seeded random point (or left to finish), then once more
    to the end; returns how many starts were killed before finishing. A point lies past the process's start-up,
    within a twelfth of the uninterrupted run's work, so that on any machine the ten kills cut a run that is
    not yet done, at different stages of it."""
    rng = random.Random(seed)
    work = max(whole_s - startup_s, 0.5)
    killed = 0
    for i in range(KILLS):
        if until_done():
            break
        p = subprocess.Popen(cmd_for(i), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(startup_s * rng.uniform(0.6, 1.1) + rng.uniform(0, work / 12))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            killed += 1
        p.wait()
    last = subprocess.run(cmd_for(KILLS), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-2000:]
    return killed


def _digest(state: dict) -> str:
    from midlayer.train.checkpoint import weights_digest

    return weights_digest(state)


def test_train_killed_ten_times_ends_as_an_uninterrupted_run(tmp_path, startup_s):
    from midlayer.train.checkpoint import list_checkpoints, load_checkpoint
    from midlayer.data.shards import write_shard

    toks = np.random.default_rng(0).integers(0, 512, 12_000)
    d = tmp_path / "shards"
    d.mkdir()
    write_shard(d / "syn_train_000.bin", toks[:9_000])
    write_shard(d / "syn_val_000.bin", toks[9_000:])
    env = _env(tmp_path)

    def cmd(out: Path, resume: bool) -> list[str]:
        return [sys.executable, "-m", "midlayer", "train", "debug", "--data", str(d / "*.bin"), "--steps", "120",
                "--ckpt-every", "3", "--no-progress", "--out-dir", str(out)] + (["--resume"] if resume else [])

    whole = tmp_path / "whole"
    whole_s = _timed(cmd(whole, False), env)
    cut = tmp_path / "cut"
    done = lambda: (cut / "eval.json").is_file()  # noqa: E731
    killed = _kill_and_resume(lambda i: cmd(cut, bool(list_checkpoints(cut))), env, 1, done, whole_s, startup_s)
    assert killed >= KILLS - 2  # the run was really cut, at (nearly) every point
    a, b = load_checkpoint(list_checkpoints(whole)[-1]), load_checkpoint(list_checkpoints(cut)[-1])
    assert a["step"] == b["step"] == 120
    assert _digest(a["model"]) == _digest(b["model"])
    assert not [p for p in cut.iterdir() if ".tmp" in p.name]


DRAFT_SCRIPT = """
import sys
from test_draft_training import cfg, tiny_base, tiny_data
from midlayer.speculative.draft_training import train_drafts
from pathlib import Path
out = Path(sys.argv[1])
c = [cfg(out, m, epochs=300) for m in ("medusa", "early-exit")]
train_drafts(c, tiny_base(), tiny_data(), progress=False, log=lambda s: None)
"""


def test_draft_training_killed_ten_times_ends_as_an_uninterrupted_run(tmp_path, startup_s):
    from safetensors.torch import load_file

    env = _env(tmp_path)
    script = tmp_path / "draft.py"
    script.write_text(DRAFT_SCRIPT)
    whole_s = _timed([sys.executable, str(script), str(tmp_path / "whole")], env)
    cut = tmp_path / "cut"
    done = lambda: all((cut / m / "draft.json").is_file() for m in ("medusa", "early-exit"))  # noqa: E731
    assert _kill_and_resume(lambda i: [sys.executable, str(script), str(cut)], env, 2, done, whole_s,
                            startup_s) >= KILLS - 2
    for m in ("medusa", "early-exit"):
        a = load_file(str(tmp_path / "whole" / m / "draft.safetensors"))
        b = load_file(str(cut / m / "draft.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


DISTILL_SCRIPT = """
import sys
from test_distill import CharTok, make_model
from midlayer.speculative.distill import distill
from midlayer.data.prompts import Prompt
prompts = [Prompt(f"p{i}", "qa", "tell me about " + "abc"[i % 3] * (i % 7 + 1), "train") for i in range(240)]
distill(make_model(), CharTok({0}), prompts, sys.argv[1], max_new_tokens=80, batch_size=2, progress=False)
"""


def test_distill_killed_ten_times_writes_the_uninterrupted_file(tmp_path, startup_s):
    env = _env(tmp_path)
    script = tmp_path / "distill.py"
    script.write_text(DISTILL_SCRIPT)
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    whole_s = _timed([sys.executable, str(script), str(whole)], env)
    assert _kill_and_resume(lambda i: [sys.executable, str(script), str(cut)], env, 3, lambda: False, whole_s,
                            startup_s) >= KILLS - 2
    assert hashlib.sha256(cut.read_bytes()).hexdigest() == hashlib.sha256(whole.read_bytes()).hexdigest()

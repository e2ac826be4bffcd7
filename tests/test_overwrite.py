"""Outputs never overwrite work they were not asked to replace (issue 43): a fresh `train` run sets aside the
log of a killed run that left no checkpoint (named), and `train-draft` does not replace a finished draft
unless told to. (`--output` naming a file of a run: tests/test_bad_inputs_train.py.)"""

from __future__ import annotations

import json

from test_concurrency import _snapshot

from midlayer.cli import main


def test_a_fresh_run_sets_aside_the_log_of_a_killed_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    old = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(5))
    (run / "metrics.jsonl").write_text(old)  # a run killed before its first checkpoint
    assert main(["train", "debug", "--steps", "2", "--out-dir", str(run), "--no-progress"]) == 0
    assert "(metrics.jsonl); moved them to *.earlier-1.*" in capsys.readouterr().err
    assert (run / "metrics.earlier-1.jsonl").read_text() == old
    new = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("loss") != 9.0 for r in new) and new



def test_a_fresh_run_sets_aside_a_finished_runs_results_whose_checkpoints_are_gone(tmp_path, capsys):
    """A finished run whose checkpoints were deleted to save disk keeps its results: a fresh run in its folder
    moves its config.json, eval.json and log aside under one number (before, it replaced config.json and
    eval.json, the file plot and sweep read, without a word)."""
    run = tmp_path / "run"
    assert main(["train", "debug", "--steps", "2", "--out-dir", str(run), "--no-progress"]) == 0
    for ckpt in run.glob("ckpt_*.pt"):
        ckpt.unlink()
    old = {name: (run / name).read_text() for name in ("config.json", "eval.json", "metrics.jsonl")}
    capsys.readouterr()
    assert main(["train", "debug", "--steps", "3", "--out-dir", str(run), "--no-progress"]) == 0
    assert "(metrics.jsonl, config.json, eval.json); moved them to *.earlier-1.*" in capsys.readouterr().err
    for name, text in old.items():
        stem, ext = name.split(".")
        assert (run / f"{stem}.earlier-1.{ext}").read_text() == text
    assert json.loads((run / "eval.json").read_text())["step"] == 3
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 3


def test_a_fresh_run_refuses_a_folder_that_holds_something_else(tmp_path, capsys):
    """A Hugging Face model folder (its config.json, its weights) or a draft is not a run's: training there is
    refused in one line and nothing in it changes (before, our config.json replaced the model's)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"weights")
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "draft.json").write_text('{"kind": "eagle"}')
    for folder, named in ((hf, "config.json (not a midlayer run's), model.safetensors"), (draft, "draft.json")):
        before = _snapshot(tmp_path)
        capsys.readouterr()
        assert main(["train", "debug", "--steps", "2", "--out-dir", str(folder), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0] and "choose another --out-dir" in err[0], err
        assert _snapshot(tmp_path) == before


def test_train_draft_does_not_replace_a_finished_draft(tmp_path, capsys):
    out = tmp_path / "eagle"
    out.mkdir()
    (out / "draft.json").write_text('{"kind": "eagle"}')
    (out / "draft.safetensors").write_bytes(b"weights")
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert main(["train-draft", "--method", "early-exit", "--out-dir", str(out), "--data",
                 str(tmp_path / "none.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a finished draft" in err[0] and "--overwrite" in err[0]
    assert _snapshot(tmp_path) == before
    # --overwrite gets past that refusal (and stops at the missing data file, writing nothing)
    assert main(["train-draft", "--method", "early-exit", "--out-dir", str(out), "--data",
                 str(tmp_path / "none.jsonl"), "--no-progress", "--overwrite"]) == 2
    assert "finished draft" not in capsys.readouterr().err
    assert {k: v for k, v in _snapshot(tmp_path).items() if not k.endswith(".lock")} == before

"""Integrity of what users hand us (issue 43): draft training refuses a distillation file made by another base
and token ids outside the vocabulary (named by file and line, at load, not an IndexError mid-run); a damaged
training state is refused in one line; `python -m midlayer.speculative.distill` refuses a file of other settings with
exit 2, like every other refusal. (Checkpoints and drafts: tests/test_bad_inputs_train.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_draft_training import cfg, tiny_base, tiny_data

from midlayer.speculative.distill import DistillFormatError, DistillRecord, DistillSet
from midlayer.speculative.draft_training import train_drafts
from midlayer.speculative.registry import DraftMismatchError, base_signature

QUIET = dict(progress=False, log=lambda s: None)


def test_token_ids_outside_the_vocabulary_are_refused_with_the_line(tmp_path):
    base, data = tiny_base(), tiny_data()
    recs = list(data.records)
    recs[5] = DistillRecord(recs[5].id, recs[5].category, recs[5].split, recs[5].prompt_ids, [3, 10**6])
    bad = DistillSet(recs, data.header, tmp_path / "d.jsonl")
    with pytest.raises(DistillFormatError, match=r"d\.jsonl:7: token id 1000000 is outside"):
        train_drafts([cfg(tmp_path, "medusa")], base, bad, **QUIET)
    assert not (tmp_path / "medusa" / "train_state.pt").exists()


def test_a_distillation_file_of_another_base_is_refused(tmp_path):
    base, data = tiny_base(), tiny_data()
    other = tiny_base()
    with __import__("torch").no_grad():
        other.output.weight.mul_(3.0)  # same shapes, another model
    foreign = DistillSet(data.records, {**data.header, "base": base_signature(other)}, tmp_path / "d.jsonl")
    with pytest.raises(DraftMismatchError, match="made by another base model"):
        train_drafts([cfg(tmp_path, "medusa")], base, foreign, **QUIET)
    own = DistillSet(data.records, {**data.header, "base": base_signature(base)}, tmp_path / "d.jsonl")
    train_drafts([cfg(tmp_path, "medusa", epochs=1)], base, own, **QUIET)  # its own base: trains


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "another object"])
def test_a_damaged_training_state_is_refused_in_one_line(tmp_path, damage):
    import torch

    base, data = tiny_base(), tiny_data()
    train_drafts([cfg(tmp_path, "medusa")], base, data, stop_after=2, **QUIET)
    state = tmp_path / "medusa" / "train_state.pt"
    good = state.read_bytes()
    if damage == "truncated":
        state.write_bytes(good[:len(good) // 2])
    elif damage == "random bytes":
        state.write_bytes(hashlib.sha256(b"x").digest() * 100)
    else:
        torch.save({"something": 1}, state)
    before = state.read_bytes()
    with pytest.raises(ValueError) as e:
        train_drafts([cfg(tmp_path, "medusa")], base, data, **QUIET)
    msg = str(e.value)
    assert "\n" not in msg and str(state) in msg and "delete it to start the run over" in msg
    assert state.read_bytes() == before


def test_distill_refusals_exit_2_in_one_line(tmp_path, capsys):
    """A file of another model / other settings: exit 2 (it was 1), one line, the file unchanged."""
    from test_distill import PROMPTS, CharTok, make_model

    from midlayer.speculative import distill

    out = tmp_path / "d.jsonl"
    distill.distill(make_model(), CharTok({0}), PROMPTS[:2], out, max_new_tokens=2, progress=False)
    before = out.read_bytes()
    with pytest.raises(SystemExit) as e:
        distill._main(["--model", "smollm2-135m", "--out", str(out), "--limit", "1", "--no-progress"])
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Warning" not in line
           and "warn" not in line]
    assert len(err) == 1 and str(out) in err[0] and err[0].startswith("python -m midlayer.speculative.distill: error:"), err
    assert Path(out).read_bytes() == before

"""Config files (issue 45, item 5): `--config FILE` on every command, the command line > the file > the preset,
`--print-config`, and a clear refusal (exit 2, one line naming the key) for every bad file."""

from __future__ import annotations

import json
import os

import pytest

from midlayer import cli
from midlayer.config import get_preset
from midlayer.train.checkpoint import list_checkpoints, load_checkpoint
from test_train import synthetic_shards


def _printed(capsys, argv: list[str]) -> dict:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_command_line_beats_the_file_which_beats_the_preset(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text('preset = "debug"\nno-progress = true\n[model]\nn_layers = 4\ngating = false\nssm_layers = [1, 2]\n'
                 '[train]\nsteps = 7\nlr = 0.002\n')
    conf = _printed(capsys, ["train", "tiny", "--config", str(f), "--steps", "5", "--print-config"])
    model, _, train = get_preset("tiny")
    assert conf["preset"] == "tiny"  # the positional given on the command line wins
    assert conf["train"]["steps"] == 5 and conf["train"]["lr"] == 0.002  # command line, then file
    assert conf["model"]["n_layers"] == 4 and conf["model"]["dim"] == model.dim  # file, then preset
    assert conf["model"]["ssm_layers"] == [1, 2]  # a comma-separated flag, given as a list
    assert conf["train"]["batch_size"] == train.batch_size and conf["no_progress"] is True
    plain = _printed(capsys, ["train", "tiny", "--print-config"])
    assert plain["train"]["steps"] == train.steps and plain["model"]["n_layers"] == model.n_layers


def test_plain_flags_and_yaml(tmp_path, capsys):
    pytest.importorskip("yaml")
    f = tmp_path / "gen.yaml"
    f.write_text("max_new_tokens: 7\nchat: true\ntemperature: 0.5\n")
    conf = _printed(capsys, ["generate", "--model", "m", "--config", str(f), "--temperature", "0", "--print-config"])
    assert (conf["max_new_tokens"], conf["chat"], conf["temperature"], conf["model"]) == (7, True, 0.0, "m")
    t = tmp_path / "bench.toml"
    t.write_text('new_tokens = 9\ntree = "chain"\n')
    conf = _printed(capsys, ["bench", "decode", "--config", str(t), "--print-config"])
    assert conf["new_tokens"] == 9 and conf["tree"] == "chain"


@pytest.mark.parametrize("text,words", [
    ("bogus = 1\n", "'bogus' is not a setting"), ("[train]\nstepz = 3\n", "has no setting 'stepz'"),
    ("[draft]\nlr = 1\n", "not a section of this command"), ('[train]\nsteps = "many"\n', "steps"),
    ("[train]\nsteps = 2.5\n", "must be int"), ("no-progress = 1\n", "true or false"),
    ("[model]\nnorm_placement = \"middle\"\n", "--norm-placement: must be one of"), ("steps = [\n", "not valid TOML"),
])
def test_bad_files_are_refused_by_name(tmp_path, capsys, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    assert cli.main(["train", "tiny", "--config", str(f), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert str(f) in err[0] or words.startswith("--norm-placement")  # a value the config itself refuses


def test_an_abbreviated_flag_still_beats_the_file(tmp_path, capsys):
    """argparse takes `--ste 3` for `--steps 3`: the command line still wins over the file (the file's 5 won)."""
    f = tmp_path / "s.toml"
    f.write_text("[train]\nsteps = 5\n")
    for flag in (["--steps", "3"], ["--step", "3"], ["--ste=3"]):
        assert _printed(capsys, ["train", "tiny", "--config", str(f), *flag, "--print-config"])["train"]["steps"] == 3
    assert _printed(capsys, ["train", "tiny", "--config", str(f), "--print-config"])["train"]["steps"] == 5


@pytest.mark.parametrize("command,text,words", [
    (["sweep", "smoke"], 'only = "dense-1"\n', None),  # a list flag given one value: a list of one, not its letters
    (["sweep", "smoke"], "only = 5\n", "only (--only) must be str, got 5"),  # (a TypeError traceback)
    (["generate", "--model", "m"], "prompt = 5\n", "prompt (--prompt) must be str, got 5"),  # (taken as 5)
    (["train", "tiny"], "steps = 5\n", "'steps' is not a setting of this command at the top; it is one of [train]"),
])
def test_a_files_values_are_read_as_the_command_line_reads_them(tmp_path, capsys, command, text, words):
    """A flag without a type takes text, as on the command line; a list flag takes one value or a list; a number
    for a text flag, and a section's setting at the top, are refused by name."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    if words is None:
        assert _printed(capsys, [*command, "--config", str(f), "--print-config"])["only"] == ["dense-1"]
        return
    assert cli.main([*command, "--config", str(f), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_yaml_nulls_and_keys_that_are_not_names_are_refused(tmp_path, capsys):
    pytest.importorskip("yaml")
    for text, words in (("max_new_tokens: null\n", "max_new_tokens (--max-new-tokens) needs a value, got null"),
                        ("1: 2\n", "a setting's name must be text, got 1"),
                        ("yes: 3\n", "a setting's name must be text, got True")):
        f = tmp_path / "g.yaml"
        f.write_text(text)
        assert cli.main(["generate", "--model", "m", "--prompt", "hi", "--config", str(f), "--print-config"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_a_missing_file_is_refused(tmp_path, capsys):
    assert cli.main(["flops", "tiny", "--config", str(tmp_path / "none.toml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_run_trains_with_the_files_settings(tmp_path, capsys):
    data = synthetic_shards(tmp_path)
    f = tmp_path / "run.toml"
    f.write_text(f'[train]\nsteps = 3\ndata = "{data}"\nckpt_every = 0\neval_tokens = 2048\n'
                 f'out_dir = "{tmp_path / "run"}"\n')
    env = os.environ.get("MIDLAYER_CACHE")
    try:
        os.environ["MIDLAYER_CACHE"] = str(tmp_path / "cache")
        assert cli.main(["train", "debug", "--config", str(f), "--no-progress"]) == 0
    finally:
        os.environ.pop("MIDLAYER_CACHE") if env is None else os.environ.__setitem__("MIDLAYER_CACHE", env)
    ckpt = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])
    assert ckpt["step"] == 3 and ckpt["configs"]["train"]["data"] == data


def test_draft_commands_print_and_help_the_configs_they_train(capsys):
    """train-gates' --print-config and --help show its method and folder (they showed train-draft's:
    hidden-transfer, runs/draft/hidden-transfer), train-draft's the folder of the method given, and --methods
    one config per method; a printed config is then a file that trains the same thing."""
    gates = _printed(capsys, ["train-gates", "--print-config"])["draft"]
    assert (gates["method"], gates["out_dir"]) == ("gates", "runs/gates")
    medusa = _printed(capsys, ["train-draft", "--method", "medusa", "--print-config"])["draft"]
    assert (medusa["method"], medusa["out_dir"]) == ("medusa", "runs/draft/medusa")
    both = _printed(capsys, ["train-draft", "--methods", "eagle,medusa", "--out-dir", "d", "--print-config"])["draft"]
    assert [(c["method"], c["out_dir"]) for c in both] == [("eagle", "d/eagle"), ("medusa", "d/medusa")]
    with pytest.raises(SystemExit):
        cli.main(["train-gates", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--method STR default 'gates'" in text and "--out-dir STR default 'runs/gates'" in text

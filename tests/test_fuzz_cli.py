"""Fuzz over the generated command surface (issue 12): every flag of `train`, `train-draft`, `generate`,
`eval`, `sweep`, `flops`, `plot` and `bench` with out-of-range, non-finite, empty and wrong-type values must end in a clean refusal -- argparse's
usage error (exit 2) or a ValueError naming the problem -- or in valid settings, never in another exception
(a traceback). Only the validation layer runs (configs and the CLI's argument checks), so it takes seconds;
the end-to-end refusals of each defect are in tests/test_bad_inputs_*.py."""

from __future__ import annotations

import argparse
import math

import pytest

from midlayer import cli
from midlayer.commands import benchmarks, drafting, experiments, generation, training
from midlayer.commands.options import overrides_from_args
from midlayer.config import get_preset

BAD = ["", "nan", "inf", "-inf", "-1", "0", "1e999", "abc", "3.5", "-0.5", "99999999999"]


def _value_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[-1] for a in parser._actions
            if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    root = cli.build_parser()
    subs = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction)).choices
    out = {name: subs[name] for name in ("train", "train-draft", "generate", "eval", "sweep", "flops", "plot",
                                         "distill")}
    bench = next(a for a in subs["bench"]._actions if isinstance(a, argparse._SubParsersAction)).choices
    out.update({f"bench {k}": v for k, v in bench.items()})
    return out


BASE = {"train": ["train", "debug"], "train-draft": ["train-draft"], "generate": ["generate", "--model", "m"],
        "eval": ["eval", "runs/no-such-run"], "sweep": ["sweep", "smoke"], "flops": ["flops", "tiny"],
        "plot": ["plot", "runs/no-such-sweep"], "bench generate": ["bench", "generate"],
        "bench decode": ["bench", "decode"], "bench static": ["bench", "static"],
        "distill": ["distill", "--model", "m", "--out", "runs/no-such/d.jsonl"]}


def _validate(cmd: str, args: argparse.Namespace) -> None:
    """What the command checks before doing any work."""
    if cmd == "train":
        get_preset(args.preset, **overrides_from_args(args))
        if args.stop_after is not None and args.stop_after < 1:
            raise ValueError("--stop-after")
    elif cmd == "train-draft":
        drafting.draft_configs(args)
    elif cmd == "eval":
        training.check_eval_args(args)
    elif cmd == "sweep":
        experiments.check_sweep_args(args)
    elif cmd == "flops":
        training.cmd_flops(args)  # pure arithmetic: the whole command
    elif cmd == "plot":
        try:
            experiments.check_plot_args(args)
        except FileNotFoundError:  # the sweep folder of BASE does not exist: a clean refusal in cli.main too
            pass
    elif cmd == "generate":
        generation.check_generate_args(args)
    elif cmd == "bench generate":
        benchmarks.check_bench_generate_args(args)
    elif cmd == "bench decode":
        try:
            benchmarks.check_bench_decode_args(args)
        except FileNotFoundError:  # the drafts/model on disk: a clean refusal in cli.main too
            pass
    elif cmd == "distill":
        __import__("midlayer.speculative.distill", fromlist=["x"]).check_args(args)
    elif cmd == "bench static":
        try:
            benchmarks.check_bench_static_args(args)
        except FileNotFoundError:  # the drafts on disk: a clean refusal in cli.main too
            pass


CASES = [(cmd, flag, v) for cmd, p in _subparsers().items() if cmd in BASE
         for flag in _value_flags(p) for v in BAD]


@pytest.mark.parametrize("cmd,flag,value", CASES, ids=[f"{c}:{f}={v}" for c, f, v in CASES])
def test_every_flag_refuses_cleanly_or_validates(cmd, flag, value, capsys):
    argv = BASE[cmd] + [f"{flag}={value}"]
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage error, exit 2
        assert e.code == 2
        return
    dest = next(a.dest for a in _subparsers()[cmd]._actions if flag in a.option_strings)
    parsed = getattr(args, dest)
    if isinstance(parsed, float) and not math.isfinite(parsed):  # never a meaningful setting: must refuse
        with pytest.raises(ValueError):
            _validate(cmd, args)
        return
    try:
        _validate(cmd, args)
    except ValueError as e:
        assert str(e) and "\n" not in str(e).strip()  # one line


DISTILL_CASES = [(flag, v) for flag in _value_flags(__import__("midlayer.speculative.distill", fromlist=["x"]).build_parser())
                 for v in BAD]


@pytest.mark.parametrize("flag,value", DISTILL_CASES, ids=[f"distill:{f}={v}" for f, v in DISTILL_CASES])
def test_every_distill_flag_refuses_cleanly_or_validates(flag, value, tmp_path):
    """`python -m midlayer.speculative.distill`, the other command line of the project: the same rule."""
    from midlayer.speculative import distill

    argv = ["--model", "m", "--out", str(tmp_path / "d.jsonl"), f"{flag}={value}"]
    try:
        args = distill.build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        return
    dest = next(a.dest for a in distill.build_parser()._actions if flag in a.option_strings)
    parsed = getattr(args, dest)
    if isinstance(parsed, float) and not math.isfinite(parsed):
        with pytest.raises(ValueError):
            distill.check_args(args)
        return
    try:
        distill.check_args(args)
    except ValueError as e:
        assert str(e) and "\n" not in str(e).strip()
    assert list(tmp_path.iterdir()) == []  # validation writes nothing


def test_distill_limit_and_temperature_refusals(tmp_path, capsys):
    from midlayer.speculative import distill

    for argv, must in ((["--limit", "-1"], "--limit must be >= 0"), (["--temperature", "nan"], "--temperature"),
                       (["--out", str(tmp_path)], "not a folder"), (["--device", "bogus"], "not a device")):
        with pytest.raises(SystemExit) as e:
            distill._main(["--model", "no-such-model", "--out", str(tmp_path / "d.jsonl"), *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert must in err[-1] and "Traceback" not in "\n".join(err)
    assert list(tmp_path.iterdir()) == []

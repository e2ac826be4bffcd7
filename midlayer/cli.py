"""The `midlayer` command: one surface for every verb. `COMMANDS` maps each subcommand to the module that
defines it (midlayer/commands/); flags of the config sections are generated from the config dataclasses.

    midlayer train tiny --steps 300 --mu-final 0.25
    torchrun --nproc_per_node 8 -m midlayer train paper-12l --data 'data/fineweb10B/*.bin'
    midlayer eval runs/tiny
    midlayer generate --model smollm2-135m --chat --prompt "Hello" --draft drafts/smollm2-135m-scale/eagle
    midlayer bench decode
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from midlayer.commands import benchmarks, config_files, data, drafting, experiments, generation, training
from midlayer.commands.options import flag_name

Command = tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]

# subcommand -> (adds its flags, runs it), each from the module of its verb (midlayer/commands/)
COMMANDS: dict[str, Command] = {
    "train": (training.add_train, training.cmd_train),
    "eval": (training.add_eval, training.cmd_eval),
    "flops": (training.add_flops, training.cmd_flops),
    "presets": (training.add_presets, training.cmd_presets),
    "generate": (generation.add_generate, generation.cmd_generate),
    "serve": (generation.add_serve, generation.cmd_serve),
    "distill": (drafting.add_distill, drafting.cmd_distill),
    "train-draft": (drafting.add_train_draft, drafting.cmd_train_draft),
    "train-gates": (drafting.add_train_gates, drafting.cmd_train_gates),
    "bench": (benchmarks.add_bench, benchmarks.cmd_bench),
    "sweep": (experiments.add_sweep, experiments.cmd_sweep),
    "plot": (experiments.add_plot, experiments.cmd_plot),
    "demo": (experiments.add_demo, experiments.cmd_demo),
    "data": (data.add_data, data.cmd_data),
    "kernels": (data.add_kernels, data.cmd_kernels),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="midlayer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    for leaf in _leaves(parser):  # issue 45: every command takes a config file and shows what it resolves to
        leaf.add_argument("--config", default=None, metavar="FILE",
                          help="settings from a TOML (or YAML) file: the command line > the file > the preset")
        leaf.add_argument("--print-config", action="store_true",
                          help="print the settings this command would run with (after --config) and exit")
    return parser


def _leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser that runs a command (subcommands of subcommands too), except the pass-through data tools."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser] if parser.prefix_chars == "-" else []
    return [leaf for p in subs[0].choices.values() for leaf in _leaves(p)]


def _leaf_for(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command `args` came from (bench's and data's subcommands included)."""
    p = parser
    while True:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return p
        p = subs[0].choices[getattr(args, subs[0].dest)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    handler = COMMANDS[args.command][1]
    leaf = _leaf_for(parser, args)
    sections = sorted({d.split(".", 1)[0] for d in (a.dest for a in leaf._actions) if "." in d})
    try:
        if getattr(args, "config", None):
            args = config_files.apply(leaf, args, argv, args.config, sections)
    except ValueError as e:
        print(f"midlayer {args.command}: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "print_config", False):
        try:
            if callable(getattr(args, "check_names", None)):  # (names a command refuses, --print-config too)
                args.check_names(args)
            config_files.print_config(config_files.resolved(args))
        except ValueError as e:  # a value the config itself refuses: one line, as for the command
            print(f"midlayer {args.command}: error: {_with_flag_name(parser, args.command, str(e))}", file=sys.stderr)
            return 2
        return 0

    try:
        return handler(args)
    except KeyboardInterrupt as e:
        # Ctrl-C: one line (train's says which checkpoint --resume continues from), exit status 130.
        if os.environ.get("MIDLAYER_DEBUG"):
            raise
        why = {"train": str(e), "sweep": "run the same command again to resume its unfinished runs"}.get(args.command)
        print(f"midlayer {args.command}: interrupted" + (f": {why}" if why else ""), file=sys.stderr)
        return 130
    except Exception as e:
        # Bad input (a bad value, path or file) or a diverged run: one clear line, no stack trace (set
        # MIDLAYER_DEBUG=1 to see it). Anything else is a bug and keeps its traceback.
        if os.environ.get("MIDLAYER_DEBUG") or not _one_line_error(e):
            raise
        print(f"midlayer {args.command}: error: {_with_flag_name(parser, args.command, str(e))}", file=sys.stderr)
        return 2


def _with_flag_name(parser: argparse.ArgumentParser, command: str, msg: str) -> str:
    """'lr: must be > 0' -> '--lr: must be > 0' where the command has that flag: the config checks name the
    field, the user typed the flag."""
    name, sep, rest = msg.partition(": ")
    if not sep or not name.isidentifier():
        return msg
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = {o for a in sub._actions for o in a.option_strings}
    return f"{flag_name(name)}: {rest}" if flag_name(name) in flags else msg


def _one_line_error(e: Exception) -> bool:
    if isinstance(e, (ValueError, OSError, ImportError)):  # OSError: a missing, unreadable or misplaced path
        return True
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
            isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):  # sizes too large for this machine
        return True
    train = sys.modules.get("midlayer.train.loop")  # loaded by every command that can raise its errors
    return train is not None and isinstance(e, train.NonFiniteLossError)


if __name__ == "__main__":
    sys.exit(main())

"""`midlayer data ...` and `midlayer kernels`: the data tools (the embedded corpus's split, FineWeb shards, the
prompt sets) and the q4 kernels' build, each the module's own command line run inside the one CLI.

    midlayer data corpus            # the embedded corpus's train / val split
    midlayer data prompts           # the base prompt set's counts (--regenerate-math rewrites the math file)
    midlayer data recipe --check    # regenerate the scaled prompt set and compare with the committed one
    midlayer data fineweb --max-tokens 1000000
    midlayer kernels                # build the q4 C kernels now and print this CPU's features
"""
from __future__ import annotations

import argparse
import runpy
import sys
import warnings

from midlayer.ops import kernels

# `midlayer data NAME ARGS` runs `python -m MODULE ARGS` (the module's own flags and --help)
DATA_TOOLS: dict[str, tuple[str, str]] = {
    "corpus": ("midlayer.data.corpus", "the embedded corpus's train / val split, with document names and sizes"),
    "prompts": ("midlayer.data.prompts", "the base prompt set's counts, or regenerate its math questions"),
    "recipe": ("midlayer.data.prompt_recipe", "build, write (--write) or check (--check) the scaled prompt set"),
    "fineweb": ("midlayer.data.fineweb", "stream FineWeb (sample-10BT), tokenize with GPT-2 BPE, write shards "
                                         "(needs the fineweb extra and a network)"),
}


def add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="data tools: the corpus split, the prompt sets, FineWeb shards")
    tools = p.add_subparsers(dest="tool", required=True)
    for name, (module, text) in DATA_TOOLS.items():
        # every argument after the tool's name is the tool's own (its --help too): no prefix is an option here
        t = tools.add_parser(name, help=text, add_help=False, prefix_chars="\x00",
                             description=f"{text} (python -m {module})")
        t.add_argument("args", nargs="*", help=f"the flags of python -m {module} (--help lists them)")


def cmd_data(args: argparse.Namespace) -> int:
    module = DATA_TOOLS[args.tool][0]
    argv = sys.argv
    sys.argv = [f"midlayer data {args.tool}", *args.args]
    try:
        with warnings.catch_warnings():  # the module may be imported already: run its __main__ block as a copy
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    except SystemExit as e:  # the tool's own argparse (--help, a bad flag) or exit status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        sys.argv = argv
    return 0


def add_kernels(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("kernels", help="build the q4 format's C kernels now (else on first use) and print this CPU's "
                                   "features")


def cmd_kernels(args: argparse.Namespace) -> int:
    return kernels.build_report()

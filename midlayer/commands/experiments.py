"""`midlayer sweep`, `plot`, `demo`: the Figure-2 experiment and the demo.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from midlayer.experiments import demo
from midlayer.experiments.plot import write_report
from midlayer.experiments.sweep import check_sweep, get_grid, run_sweep




GRID_HELP = {  # (a test holds it to sweep.GRIDS)
    "cpu": "Figure 2 at tiny width on 2 CPU cores, one seed", "cpu-seeds": "cpu with 3 seeds, key- and "
    "query-indexed gating (docs/skip-middle.md)", "cpu-noise": "two cpu-seeds runs with a 1e-7 weight perturbation",
    "smoke": "seconds, debug width", "paper": "Table 2 on FineWeb (GPUs)", "parts": "issue 13's one-part-at-a-time "
    "ablation (docs/results/parts-cpu.md)", "parts-smoke": "the parts grid in seconds"}


def add_sweep(sub: argparse._SubParsersAction) -> None:
    # ---- Figure-2 sweep and plot (midlayer/experiments/sweep.py, midlayer/experiments/plot.py)
    p = sub.add_parser("sweep", help="train a named grid of runs (Figure 2), skipping finished runs and "
                                     "resuming unfinished ones")
    p.add_argument("grid", help="; ".join(f"{name}: {what}" for name, what in GRID_HELP.items()))
    p.add_argument("--out-dir", default="runs/sweep", help="runs go to OUT_DIR/GRID/RUN (default runs/sweep)")
    p.add_argument("--launcher", choices=["inline", "torchrun"], default="inline",
                   help="inline: train in this process; torchrun: one `torchrun -m midlayer train` per run")
    p.add_argument("--nproc", type=int, default=1, help="processes per run with --launcher torchrun")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these runs of the grid")
    p.add_argument("--data", default=None, metavar="GLOB",
                   help="training data of every run (the paper grid defaults to data/fineweb10B/fineweb_*.bin)")
    p.set_defaults(check_names=check_sweep_names)  # (what --print-config checks too)


def add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="Figure 2 (PNG) and tables (CSV, Markdown) of a sweep's results")
    p.add_argument("sweep_dir", help="a sweep folder, e.g. runs/sweep/cpu")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="writes PREFIX.png/.csv/.md (default SWEEP_DIR/figure2, a parts sweep's SWEEP_DIR/parts-table; "
                        "the committed reports: --out docs/results/figure2-cpu, docs/results/parts-cpu-table)")


def cmd_sweep(args: argparse.Namespace) -> int:
    return run_sweep(args.grid, Path(args.out_dir), launcher=args.launcher, nproc=args.nproc, only=args.only,
                     extra_train=check_sweep_args(args))


def check_sweep_names(args: argparse.Namespace) -> None:
    """The grid and --only's run names (ValueError listing the known ones): checked by --print-config too, which
    printed the settings of a grid that does not exist."""
    grid = get_grid(args.grid)
    for name in args.only or ():
        grid.run(name)


def check_sweep_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """What `sweep` checks before its first run; returns the train overrides of every run."""

    if args.data is not None and not args.data.strip():
        raise ValueError("--data: an empty glob; give the training data's files, e.g. 'data/fineweb10B/*.bin'")
    if not str(args.out_dir).strip():
        raise ValueError("--out-dir: an empty path")
    extra = {"data": args.data} if args.data is not None else None
    check_sweep(args.grid, Path(args.out_dir), launcher=args.launcher, nproc=args.nproc, only=args.only,
                extra_train=extra)
    return extra


def check_plot_args(args: argparse.Namespace) -> None:
    """What `plot` checks before reading the sweep: an output prefix with a file name, an existing folder."""
    if args.out is not None and (not args.out.strip() or not Path(args.out).name or args.out.endswith(("/", "."))):
        raise ValueError(f"--out {args.out!r}: give a file prefix, e.g. docs/results/figure2-cpu")
    if args.out is not None and Path(args.out).parent.exists() and not Path(args.out).parent.is_dir():
        raise ValueError(f"--out {args.out}: {Path(args.out).parent} is a file, not a folder")
    if not Path(args.sweep_dir).is_dir():
        raise FileNotFoundError(f"{args.sweep_dir} is not a folder (a sweep's output, e.g. runs/sweep/cpu)")


def cmd_plot(args: argparse.Namespace) -> int:
    check_plot_args(args)
    for path in write_report(Path(args.sweep_dir), args.out).values():
        print(f"wrote {path}")
    return 0


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the README's first command: the tiny gated model and its dense baseline on the "
                                    "embedded corpus, then a comparison table (make demo)")
    demo.add_arguments(p)


def cmd_demo(args: argparse.Namespace) -> int:
    return demo.run(args)

"""Training throughput of every part of the `parts` grid (issue 13), measured quietly and interleaved.

    python benchmarks/parts_throughput.py                      # every part, writes sweeps/parts/throughput.json
    python benchmarks/parts_throughput.py --only baseline,mqa,moe-4-top2 --repeats 5

Why a benchmark and not the sweep's own numbers: each sweep run records its training tokens/s, but runs
minutes or hours apart, often beside other jobs, so those numbers compare machines' moods, not parts. Here
every part's model (seed 0's config from the grid, exactly as `midlayer sweep parts` builds it) takes one
training step in turn, round after round (the order reverses every round), and each part's speed is given
as the median over rounds of its ratio to the baseline's step *in the same round*. The step is the one
`midlayer bench train` times (the trainer's objective, backward, grad-norm, AdamW). Random tokens:
speed does not depend on the text. Check the machine is otherwise idle first
(`pgrep -f "midlayer sweep|midlayer train|pytest"`).

`midlayer plot sweeps/parts` reads `throughput.json` from the sweep folder, when present, for the table's
speed columns instead of the runs' own.
Written up in docs/results/parts-cpu.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from midlayer.ops.kernels import cpu_info  # noqa: E402
from midlayer.experiments.plot import point_name  # noqa: E402
from midlayer.experiments.sweep import get_grid, resolve_run  # noqa: E402
from midlayer.experiments.train_bench import cpu_model, ours  # noqa: E402


def part_models(grid, only: list[str] | None) -> dict[str, tuple[str, Any]]:
    """{part: (preset, ModelConfig of its seed-0 run)} in grid order, without the stability (lr) runs."""
    parts = {}
    for spec in grid.runs:
        if "-lr" in spec.name or not spec.name.endswith("-s0"):
            continue
        m, _, _ = resolve_run(grid, spec, Path("unused"))
        parts[point_name(spec.name)] = (spec.preset, m)
    if only:
        unknown = [p for p in only if p not in parts]
        if unknown:
            raise ValueError(f"--only: unknown parts {unknown}; known: {', '.join(parts)}")
        parts = {p: parts[p] for p in parts if p in only or p == "baseline"}
    if "baseline" not in parts:
        raise ValueError(f"grid {grid.name!r} has no baseline part to compare with")
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--grid", default="parts", help="a parts grid of midlayer/experiments/sweep.py (default parts)")
    p.add_argument("--only", default=None, help="comma-separated parts (the baseline is always timed)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", default=None,
                   help="JSON to write (default sweeps/<grid>/throughput.json; '-' writes none)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    try:
        grid = get_grid(args.grid)
        parts = part_models(grid, only)
    except ValueError as e:  # an unknown grid or part: one line, exit 2
        p.error(str(e))
    t = resolve_run(grid, grid.runs[0], Path("unused"))[2]
    vocab = next(iter(parts.values()))[1].vocab_size
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (t.micro_batch_size, t.seq_len + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    tokens = t.micro_batch_size * t.seq_len

    benches = {}
    for name, (preset, m) in parts.items():
        benches[name] = ours(preset, name, name, x, y, torch.float32, True, **vars(m))[0]
    order = list(benches)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for _ in range(args.warmup):
        for name in order:
            benches[name].step()
    secs: dict[str, list[float]] = {name: [] for name in order}
    util: dict[str, list[float]] = {name: [] for name in order}
    for r in range(args.repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            benches[name].step()
            c1, t1 = time.process_time(), time.perf_counter()
            secs[name].append(t1 - t0)
            util[name].append((c1 - c0) / (t1 - t0))
        print(f"# round {r + 1}/{args.repeats}: baseline {tokens / secs['baseline'][-1]:,.0f} tok/s", file=sys.stderr)

    rows = {}
    for name in order:
        ratio = statistics.median(secs["baseline"][r] / secs[name][r] for r in range(args.repeats))
        rows[name] = {"tokens_per_s": tokens / statistics.median(secs[name]), "speed_vs_baseline": ratio,
                      "params": benches[name].n_params, "cpu_util": statistics.median(util[name])}
    meta = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu_model(),
            "cpu_flags": ",".join(cpu_info().vector_flags()) or "no AVX2",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "grid": args.grid,
            "tokens_per_step": tokens, "repeats": args.repeats, "warmup": args.warmup,
            "load_before": load_before,
            "command": " ".join(["python benchmarks/parts_throughput.py", *(sys.argv[1:] if argv is None else argv)])}
    print(f"Training throughput per part ({args.grid} grid), fp32, {t.micro_batch_size} x {t.seq_len} tokens/step, "
          f"{args.repeats} interleaved rounds after {args.warmup} warm-up rounds; {meta['cpu']} ({meta['cpu_flags']}), "
          f"{meta['threads']} threads, torch {meta['torch']}, load before {load_before:.2f}.")
    print()
    print("| part | params | median tokens/s | speed vs baseline (median per-round ratio) | CPU util |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['params']:,} | {r['tokens_per_s']:,.0f} | {r['speed_vs_baseline']:.3f} | "
              f"{r['cpu_util']:.2f} |")
    out = args.out if args.out is not None else str(Path("sweeps") / args.grid / "throughput.json")
    if out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "parts": rows}, indent=1) + "\n")
        print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

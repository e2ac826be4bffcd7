"""The README's first command: train the `tiny` gated skip-middle model and its dense baseline on the
embedded Shakespeare corpus, then print a comparison table.

Runs go to runs/demo/{gated,dense}. A finished run is not retrained (its eval.json is reused); a killed one
resumes from its last checkpoint. `midlayer demo --steps 50` makes a quicker, rougher demo.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from midlayer.common import atomic_write
from midlayer.train.checkpoint import list_checkpoints
from midlayer.config import get_preset
from midlayer.train.loop import train


def run_one(preset: str, out_dir: Path, steps: int | None, progress: bool = True) -> dict:
    done = out_dir / "eval.json"
    train_over = {"out_dir": str(out_dir), "ckpt_every": 50}
    if steps is not None:
        train_over["steps"] = steps
    model_cfg, sparsity_cfg, train_cfg = get_preset(preset, train=train_over)
    if done.exists():
        try:
            res = json.loads(done.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:  # (not the demo's own: it writes whole or not at all)
            print(f"note: {done} is not valid JSON ({e}); the run is taken as unfinished")
            res = None
        if isinstance(res, dict) and res.get("step") == train_cfg.steps:
            print(f"{out_dir}: finished earlier, reusing {done}")
            return res
    t0 = time.perf_counter()
    res = train(model_cfg, sparsity_cfg, train_cfg, resume=bool(list_checkpoints(out_dir)), progress=progress)
    res["wall_s"] = time.perf_counter() - t0
    atomic_write(done, json.dumps(res, indent=2).encode("utf-8"))
    return res


def table(rows: dict[str, dict]) -> str:
    dense = rows.get("dense", {})
    lines = ["| model | params | val CE | val ppl | sparsity | est. GFLOPs/seq | vs dense | train tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        rel = r["flops_per_seq"] / dense["flops_per_seq"] if dense else float("nan")
        tps = r.get("train_tokens_per_s")
        lines.append(f"| {name} | {r['params']:,} | {r['val_ce']:.4f} | {r['val_ppl']:.1f} | "
                     f"{r['mean_sparsity']:.3f} | {r['flops_per_seq'] / 1e9:.3f} | {rel:.3f} | "
                     + (f"{tps:,.0f} |" if tps else "- |"))  # (a resumed run that took no step has no tok/s)
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per model (default: the preset's)")
    ap.add_argument("--out-dir", default="runs/demo")


def main(argv: list[str] | None = None) -> int:
    """`python -m midlayer.experiments.demo` (`make demo`); `midlayer demo` is the same."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Both runs (trained, resumed or reused), then the table."""
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")
    out = Path(args.out_dir)
    t0 = time.perf_counter()
    rows = {"gated": run_one("tiny", out / "gated", args.steps),
            "dense": run_one("tiny-dense", out / "dense", args.steps)}
    m, s, t = get_preset("tiny")
    print()
    print(f"tiny preset: dim {m.dim}, {m.n_layers} layers, vocab {m.vocab_size}, seq {t.seq_len}, "
          f"{args.steps or t.steps} steps x {t.batch_size} sequences; gated: {s.controller} controller, "
          f"mu0 {s.mu0} -> mu_final {s.mu_final}")
    print(table(rows))
    g = rows["gated"]
    if "gate_sparsity" in g:
        half = len(g["gate_sparsity"]) // 2
        print("gated, per first-half block: mean gate "
              + ", ".join(f"{x:.3f}" for x in g["gate_mean"][:half])
              + " | sparsity " + ", ".join(f"{x:.3f}" for x in g["gate_sparsity"][:half]))
    print(f"wall time {time.perf_counter() - t0:.0f} s; runs and metrics in {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

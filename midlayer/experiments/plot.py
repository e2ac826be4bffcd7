"""Tables and the Figure-2 plot of a finished (or partly finished) sweep (`midlayer.experiments.sweep`).

`collect(sweep_dir)` reads every run's `eval.json` with its config; `write_table` writes a CSV and a Markdown
report; `plot_figure2` draws the paper's Figure 2: validation cross-entropy against estimated forward FLOPs
per sequence (left) and against mean gate sparsity (right).

The Markdown report also answers whether the sparsity controller met its layer-wise targets: for each gated
run it lists, per first-half block l, the measured mean gate, the sparsity (fraction of exactly-zero gates)
and the target mu*_l (linear from mu0 at block 0 to mu_final at block L/2-1, `sparsity.mean_targets`), and
whether |mean gate - mu*_l| <= delta, the controller's dead band (within it the controller stops adjusting,
so that is the precision it aims for). Gate statistics are those of the final evaluation (validation text) and,
since the controller acts on training batches and the two differ by more than delta at small budgets, the mean of
the logged training steps over the last TRAIN_GATE_WINDOW steps (`train_gate_means`). A sweep with seeds also gets
one row per point and block: the mean over seeds on both sides and the number of seeds within delta.

Whether one more dense layer helps beyond the seed spread is judged on per-seed differences (`depth_steps`), and
whether gating beats dense models with fewer layers at equal estimated FLOPs (`equal_flops_gaps`): per
seed, the gated run's CE minus the same seed's dense curve at the gated run's FLOPs, with a 95% t interval over
the seeds, so that a difference is called only where it exceeds the seed spread. Key- and query-indexed gating
(`gating_differences`) are compared through those gaps, seed by seed.

    midlayer plot sweeps/cpu-seeds --out docs/results/figure2-cpu   # docs/results/figure2-cpu.{png,csv,md}
    midlayer plot runs/sweep/cpu                   # runs/sweep/cpu/figure2.{png,csv,md}
    midlayer plot runs/sweep/cpu --out /tmp/fig2   # /tmp/fig2.{png,csv,md}
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from midlayer.config import from_dict, ModelConfig, SparsityConfig
from .sweep import diverged, KIND_DENSE, KIND_GATED, KIND_NO_CONTROL, PARTS_PLACEMENT_PART
from midlayer.model.flops import active_param_count, forward_flops, param_count
from midlayer.model.sparsity import mean_targets

CSV_COLUMNS = ("run", "kind", "n_layers", "controller", "mu0", "mu_final", "val_ce", "val_ppl", "mean_sparsity",
               "flops_per_seq", "flops_per_seq_dense_equiv", "flops_ratio", "params", "active_params",
               "train_tokens_per_s", "step", "finished", "wall_s", "machine")
DEFAULT_DELTA = 0.01  # SparsityConfig.delta's default, for runs whose config is not on disk
# The controller acts on training batches, so the report also judges each block on them: the mean of the logged
# training steps (`gate_mean/l` in metrics.jsonl, every log_every-th step) over this many final steps.
TRAIN_GATE_WINDOW = 100
_TOL = 1e-9  # so that a difference of exactly delta counts as met despite binary rounding


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def train_gate_means(run_dir: Path | str, window: int = TRAIN_GATE_WINDOW) -> list[float] | None:
    """Per first-half block, the mean gate on the training batches the controller saw over the run's last `window`
    steps: the average of the logged `gate_mean/l` of steps in (last - window, last]. A resumed run may have
    logged a step twice; its last record counts. None when the log holds no gate statistics."""
    if window < 1:
        raise ValueError(f"window must be >= 1 steps, got {window}")
    by_step: dict[int, dict[str, Any]] = {}
    try:
        with open(Path(run_dir) / "metrics.jsonl") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill: the steps around it still count
                if isinstance(rec, dict) and "gate_mean/0" in rec and isinstance(rec.get("step"), int):
                    by_step[rec["step"]] = rec
    except OSError:
        return None
    if not by_step:
        return None
    last = max(by_step)
    recs = [r for k, r in by_step.items() if k > last - window]
    half = sum(1 for k in recs[0] if k.startswith("gate_mean/"))
    return [sum(r[f"gate_mean/{l}"] for r in recs) / len(recs) for l in range(half)]


def _sweep_runs(sweep: dict | None) -> list[dict]:
    """sweep.json's run records (none where its runs are not a list: a hand-edited file)."""
    runs = (sweep or {}).get("runs")
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def _run_dirs(sweep_dir: Path, sweep: dict | None) -> list[Path]:
    """The runs sweep.json names, in its order; without one, every folder holding an eval.json. A folder the
    sweep does not name (a copy moved aside, `dense-2-s1.old`) is left out with a note: counted, it was a point
    of its own and replaced its namesake in the paired depth comparison."""
    ordered = [sweep_dir / r["name"] for r in _sweep_runs(sweep) if isinstance(r.get("name"), str)]
    rest = sorted(p.parent for p in sweep_dir.glob("*/eval.json") if p.parent not in ordered)
    if not ordered:
        return rest
    for p in rest:
        print(f"plot: {p.name}: not a run of {sweep_dir / 'sweep.json'}, left out", file=sys.stderr)
    return ordered


def estimated_costs(model: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """`flops_per_seq` (estimated FLOPs per sequence at the run's measured sparsity), `flops_per_seq_dense_equiv`
    (the same at sparsity 0) and `active_params`, under the current cost model (`flops.py`), from the run's
    model config and its eval.json (`seq_len`, `gate_sparsity`), so that a correction of the cost model reaches
    runs evaluated before it. The numbers eval.json stored are kept where the config is missing, cannot be
    rebuilt (a run from another version) or does not describe the evaluated model (depth or parameter count
    differ)."""
    stored = {k: res.get(k) for k in ("flops_per_seq", "flops_per_seq_dense_equiv", "active_params")}
    if not model:
        return stored
    try:
        cfg = from_dict(ModelConfig, model)
    except (TypeError, ValueError):
        return stored
    seq_len, z = res.get("seq_len"), res.get("gate_sparsity")
    if (not isinstance(seq_len, int) or (cfg.gating and not z) or res.get("n_layers", cfg.n_layers) != cfg.n_layers
            or res.get("params", param_count(cfg)) != param_count(cfg)):
        return stored
    sparsity = [float(v) for v in z[: cfg.n_layers // 2]] if cfg.gating else None
    return {"flops_per_seq": forward_flops(cfg, seq_len, sparsity).total,
            "flops_per_seq_dense_equiv": forward_flops(cfg, seq_len).total,
            "active_params": float(active_param_count(cfg, sparsity))}


def collect(sweep_dir: Path | str) -> list[dict[str, Any]]:
    """One row per run of `sweep_dir` whose eval.json holds a final evaluation (val_ce).

    Metadata (kind, depth, controller, mu0, mu_final, delta) comes from the run's config.json, else from
    sweep.json, else from eval.json alone; the seed from the config, else the run's name (`run_seed`); the gating
    index only from the config (None: left out of the pooled and key-vs-query comparisons). Unfinished runs (no
    val_ce yet) are left out with a note.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir} is not a folder")
    sweep = _read_json(sweep_dir / "sweep.json")
    sweep = sweep if isinstance(sweep, dict) else None
    meta_by_name = {r["name"]: r for r in _sweep_runs(sweep) if "name" in r}
    rows: list[dict[str, Any]] = []
    for run_dir in _run_dirs(sweep_dir, sweep):
        res = _read_json(run_dir / "eval.json")
        if not isinstance(res, dict) or "val_ce" not in res:
            if run_dir.is_dir():
                print(f"plot: {run_dir.name}: no final evaluation yet, left out", file=sys.stderr)
            continue
        ce = res["val_ce"]
        if isinstance(ce, bool) or not isinstance(ce, (int, float)) or not math.isfinite(ce):
            # (a diverged run's CE is written as null: it crashed the whole table)
            print(f"plot: {run_dir.name}: its final val_ce is {ce!r}, left out", file=sys.stderr)
            continue
        cfg = _read_json(run_dir / "config.json") or {}
        meta = meta_by_name.get(run_dir.name, {})
        model, sparsity = cfg.get("model") or {}, cfg.get("sparsity") or {}
        gating = bool(model.get("gating", res.get("gating", meta.get("kind", KIND_DENSE) != KIND_DENSE)))
        controller = sparsity.get("controller", meta.get("controller")) if gating else None
        if not gating:
            kind = KIND_DENSE
        elif controller == "none":
            kind = KIND_NO_CONTROL
        else:
            kind = KIND_GATED
        # The fixed-coefficient controllers ignore mu*; only the target-tracking ones are judged against it.
        has_targets = kind == KIND_GATED and controller not in ("sparsity", "sparsity_variance")
        cost = estimated_costs(model, res)
        flops, dense_equiv = cost["flops_per_seq"], cost["flops_per_seq_dense_equiv"]
        row = {
            "run": run_dir.name,
            "kind": kind,
            "n_layers": int(model.get("n_layers", res.get("n_layers", meta.get("n_layers", 0)))),
            "controller": controller,
            "mu0": sparsity.get("mu0", meta.get("mu0")) if has_targets else None,
            "mu_final": sparsity.get("mu_final", meta.get("mu_final")) if has_targets else None,
            "delta": sparsity.get("delta", DEFAULT_DELTA) if has_targets else None,
            "val_ce": res["val_ce"],
            "val_ppl": res["val_ppl"] if "val_ppl" in res else math.exp(min(ce, 50.0)),
            "mean_sparsity": res.get("mean_sparsity", 0.0),
            "flops_per_seq": flops,
            "flops_per_seq_dense_equiv": dense_equiv,
            "flops_ratio": flops / dense_equiv if dense_equiv and flops is not None else None,
            "params": res.get("params"),
            "active_params": cost["active_params"],
            "train_tokens_per_s": res.get("train_tokens_per_s"),
            "step": res.get("step"),
            "finished": res.get("finished"),
            # The sweep's record of the run: seconds of training + evaluation (a run resumed in a later sitting
            # records only its resumed part) and the machine it ran on (the sweep's `machine` string).
            "wall_s": meta.get("wall_s"),
            "machine": meta.get("machine"),
            "gate_mean": list(res.get("gate_mean") or []),
            "gate_sparsity": list(res.get("gate_sparsity") or []),
            "grid": (sweep or {}).get("grid", sweep_dir.name),
            "point": point_name(run_dir.name),
            "seed": run_seed(run_dir.name, cfg),
            # (unknown without the run's config: taken for "key", query runs were pooled with key ones)
            "gate_attention": model.get("gate_attention", "key") if gating and model else None,
            "train_gate_mean": train_gate_means(run_dir) if gating else None,
        }
        rows.append(row)
    return rows


def _wall_summary(rows: list[dict[str, Any]], grid: str) -> str:
    """How the runs were made: the command that continues the grid, the recorded wall time, the machines."""
    timed = [r["wall_s"] for r in rows if r.get("wall_s") is not None]
    machines = sorted({r["machine"] for r in rows if r.get("machine")})
    text = (f"Made with `midlayer sweep {grid} --out-dir <dir>` (resumable: the same command skips finished runs "
            f"and continues a stopped one from its last checkpoint) and `midlayer plot <dir>/{grid}`.")
    if timed:
        text += (f" Recorded wall time: {sum(timed) / 3600:.1f} h over {len(timed)} runs "
                 f"({min(timed) / 60:.1f}-{max(timed) / 60:.1f} min a run; a run resumed in a later sitting "
                 "records only its resumed part).")
    if machines:
        text += " Machine: " + "; ".join(machines) + "."
    return text


def run_seed(run: str, cfg: dict[str, Any]) -> int | None:
    """A run's seed: its config's, else its name's `-sN` suffix (a sweep's names), else None. (Without the config
    every seed was None: the paired comparisons pooled all seeds' dense runs into one curve.)"""
    seed = (cfg.get("train") or {}).get("seed")
    if seed is None and (m := re.search(r"-s(\d+)$", run)):
        seed = int(m.group(1))
    return seed


def point_name(run: str) -> str:
    """The point a run belongs to: its name without a trailing seed suffix ("dense-3-s1" -> "dense-3")."""
    return re.sub(r"-s\d+$", "", run)


def _stats(xs: list[float]) -> tuple[float, float, float, float]:
    """mean, sample std (0 for one value), min, max."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std, min(xs), max(xs)


POINT_COLUMNS = ("point", "kind", "gate_attention", "n_layers", "mu_final", "seeds", "val_ce_mean", "val_ce_std",
                 "val_ce_min", "val_ce_max", "mean_sparsity_mean", "mean_sparsity_std", "flops_per_seq_mean",
                 "flops_per_seq_std", "flops_ratio_mean", "targets_met")


def by_point(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The runs of each point (runs that differ only in seed), in the order the points first appear."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r.get("point") or point_name(r["run"]), []).append(r)
    return groups


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point (runs that differ only in seed): mean, sample std, min and max of val CE, and mean/std
    of sparsity and estimated FLOPs; `targets_met` counts the seeds whose every block met its target."""
    out = []
    for point, rs in by_point(rows).items():
        first = rs[0]
        ce = _stats([r["val_ce"] for r in rs])
        sp = _stats([r.get("mean_sparsity") or 0.0 for r in rs])
        fl = [r["flops_per_seq"] for r in rs if r.get("flops_per_seq") is not None]
        fr = [r["flops_ratio"] for r in rs if r.get("flops_ratio") is not None]
        met = None
        if first["kind"] == KIND_GATED and first.get("mu_final") is not None:
            met = sum(all(c["met"] for c in block_check(r)) for r in rs)
        out.append({"point": point, "kind": first["kind"], "gate_attention": first.get("gate_attention"),
                    "n_layers": first["n_layers"], "mu_final": first.get("mu_final"), "seeds": len(rs),
                    "val_ce_mean": ce[0], "val_ce_std": ce[1], "val_ce_min": ce[2], "val_ce_max": ce[3],
                    "mean_sparsity_mean": sp[0], "mean_sparsity_std": sp[1],
                    "flops_per_seq_mean": _stats(fl)[0] if fl else None,
                    "flops_per_seq_std": _stats(fl)[1] if fl else None,
                    "flops_ratio_mean": _stats(fr)[0] if fr else None, "targets_met": met,
                    "grid": first.get("grid")})
    return sorted(out, key=lambda p: (_sort_key({**p, "run": p["point"]}), p.get("gate_attention") or ""))


# Two-sided 95% quantiles of Student's t by degrees of freedom (standard tables), for the confidence interval of a
# mean over a few seeds; beyond the table `t975`'s expansion (the normal quantile alone, 1.96, made the interval of
# 12 seeds a 92% one).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t975(df: int) -> float:
    """Student's t 0.975 quantile: the table to 10 degrees of freedom, then the Cornish-Fisher expansion in 1/df
    around the normal quantile (Abramowitz & Stegun 26.7.5; within 1e-4 of the exact value from df 8 on)."""
    if df in _T975:
        return _T975[df]
    z, v = 1.959963984540054, float(df)
    return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))


def paired_difference(diffs: list[float], names: tuple[str, str] = ("lower", "higher")) -> dict[str, Any]:
    """Mean, sample std and 95% t half-width of per-seed differences; `verdict` is names[0] where the interval
    lies below 0, names[1] where above, "within noise" where it holds 0, "one seed" with no spread to judge."""
    mean, std, _, _ = _stats(diffs)
    n = len(diffs)
    half = t975(n - 1) * std / math.sqrt(n) if n > 1 else None
    if half is None:
        verdict = "one seed"
    elif mean + half < 0:
        verdict = names[0]
    elif mean - half > 0:
        verdict = names[1]
    else:
        verdict = "within noise"
    return {"mean": mean, "std": std, "ci95": half, "verdict": verdict}


def depth_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whether one more dense layer separates beyond the seed spread: for each pair of consecutive dense depths,
    the per-seed difference val CE(deeper) - val CE(shallower), summarised by `paired_difference`."""
    ce: dict[int, dict[Any, float]] = {}
    for r in rows:
        if r["kind"] == KIND_DENSE:
            ce.setdefault(int(r["n_layers"]), {})[r.get("seed")] = float(r["val_ce"])
    depths = sorted(ce)
    out = []
    for a, b in zip(depths, depths[1:]):
        seeds = [k for k in ce[a] if k in ce[b]]
        if seeds:
            diffs = [ce[b][k] - ce[a][k] for k in seeds]
            out.append({"from": a, "to": b, "seeds": len(seeds), "diffs": diffs,
                        **paired_difference(diffs, ("deeper lower", "deeper higher"))})
    return out


def dense_at(flops: float, dense: list[tuple[float, float]]) -> float | None:
    """Validation CE of the dense models at `flops` estimated FLOPs per sequence: linear interpolation between
    the two dense depths whose FLOPs bracket it (`dense` holds (flops, val CE) pairs). None outside their range:
    a depth the sweep did not train is not guessed."""
    pts = sorted(dense)
    for (f0, c0), (f1, c1) in zip(pts, pts[1:]):
        if f0 <= flops <= f1:
            return c0 if f1 == f0 else c0 + (c1 - c0) * (flops - f0) / (f1 - f0)
    return pts[0][1] if len(pts) == 1 and pts[0][0] == flops else None


def equal_flops_gaps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per gated point, its validation CE minus that of a dense model of equal estimated FLOPs, paired by seed:
    for each seed, the gated run's CE minus the same seed's dense curve (`dense_at`) at the gated run's FLOPs.
    Pairing removes what a seed moves in both (data order, initialisation). Returns, per point, the per-seed
    gaps, their mean, sample std, a 95% t interval of the mean, and how many seeds the gated run was lower in;
    `verdict` says whether the interval excludes 0. Seeds without >= 2 dense depths around the point are left out."""
    dense_by_seed: dict[Any, list[tuple[float, float]]] = {}
    for r in rows:
        if r["kind"] == KIND_DENSE and r.get("flops_per_seq") is not None:
            dense_by_seed.setdefault(r.get("seed"), []).append((float(r["flops_per_seq"]), float(r["val_ce"])))
    out = []
    for point, rs in by_point([r for r in rows if r["kind"] != KIND_DENSE]).items():
        gaps, dense_ce, flops, by_seed = [], [], [], {}
        for r in rs:
            d = (dense_at(float(r["flops_per_seq"]), dense_by_seed.get(r.get("seed"), []))
                 if r.get("flops_per_seq") is not None else None)
            if d is not None:
                gaps.append(r["val_ce"] - d)
                by_seed[r.get("seed")] = gaps[-1]
                dense_ce.append(d)
                flops.append(float(r["flops_per_seq"]))
        if not gaps:
            continue
        d = paired_difference(gaps, ("gated lower", "dense lower"))
        n = len(gaps)
        out.append({"point": point, "kind": rs[0]["kind"], "gate_attention": rs[0].get("gate_attention"),
                    "mu_final": rs[0].get("mu_final"), "seeds": n, "gaps": gaps, "gap_by_seed": by_seed,
                    "flops_per_seq_mean": sum(flops) / n, "dense_ce_mean": sum(dense_ce) / n,
                    "val_ce_mean": sum(dense_ce) / n + d["mean"], "gap_mean": d["mean"], "gap_std": d["std"],
                    "gap_ci95": d["ci95"], "gated_lower": sum(g < 0 for g in gaps), "verdict": d["verdict"]})
    return sorted(out, key=lambda p: (_sort_key({**p, "run": p["point"], "n_layers": 0}), p.get("gate_attention") or ""))


def gating_differences(gaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Key- vs query-indexed gating (eq. 3 as written vs the reference code) at the same controller setting:
    per seed, the key-gated point's equal-FLOPs gap (`equal_flops_gaps`) minus the query-gated one's, so that
    the two are compared at equal estimated FLOPs even where their sparsities differ. Summarised by
    `paired_difference` over the seeds both points have."""
    query = {(g["kind"], g.get("mu_final")): g for g in gaps if g.get("gate_attention") == "query"}
    out = []
    for k in gaps:
        q = query.get((k["kind"], k.get("mu_final"))) if k.get("gate_attention") == "key" else None
        seeds = [s for s in k["gap_by_seed"] if q is not None and s in q["gap_by_seed"]]
        if not seeds:
            continue
        diffs = [k["gap_by_seed"][s] - q["gap_by_seed"][s] for s in seeds]
        out.append({"key": k["point"], "query": q["point"], "kind": k["kind"], "mu_final": k.get("mu_final"),
                    "seeds": len(seeds), "diffs": diffs, **paired_difference(diffs, ("key lower", "query lower"))})
    return out


def pooled_gaps(gaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per gating index over all of its points: for each seed that every point of that index has,
    the mean of the points' equal-FLOPs gaps (`equal_flops_gaps`); then `paired_difference` over those per-seed
    means. Averaging within a seed first keeps the points of one seed (which share its data order and dense
    curve, so are not independent) from counting as separate samples. Indexes with no common seed are left out."""
    out = []
    for index in sorted({g.get("gate_attention") for g in gaps if g.get("gate_attention")}):
        points = [g for g in gaps if g.get("gate_attention") == index]
        seeds = sorted(set.intersection(*(set(g["gap_by_seed"]) for g in points)), key=str)
        if not seeds:
            continue
        means = [sum(g["gap_by_seed"][s] for g in points) / len(points) for s in seeds]
        out.append({"gate_attention": index, "points": len(points), "seeds": len(seeds), "seed_means": means,
                    **paired_difference(means, ("gated lower", "dense lower"))})
    return out


def block_targets(mu0: float, mu_final: float, n_layers: int) -> list[float]:
    """Mean-gate targets mu*_l of the first-half blocks, as the controller computes them."""

    t = mean_targets(SparsityConfig(mu0=mu0, mu_final=mu_final), n_layers)
    return [float(x) for x in t[: n_layers // 2]]


def block_check(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Per first-half block of a gated row: mean gate, sparsity, target, |diff| and whether it is <= delta, on the
    final evaluation (validation text) and, where the row has them, on the last training batches (`train_*`).
    Runs without a controller (or without targets) get target/diff/met = None."""
    half = row["n_layers"] // 2
    means, zeros = row.get("gate_mean") or [], row.get("gate_sparsity") or []
    train = row.get("train_gate_mean") or []
    targets: list[float | None] = [None] * half
    if row["kind"] == KIND_GATED and row.get("mu0") is not None and row.get("mu_final") is not None:
        targets = block_targets(float(row["mu0"]), float(row["mu_final"]), row["n_layers"])
    delta = row.get("delta") if row.get("delta") is not None else DEFAULT_DELTA
    out = []
    for b in range(half):
        mean = means[b] if b < len(means) else None
        target = targets[b]
        diff = abs(mean - target) if (mean is not None and target is not None) else None
        tmean = train[b] if b < len(train) else None
        tdiff = abs(tmean - target) if (tmean is not None and target is not None) else None
        out.append({"block": b, "gate_mean": mean, "sparsity": zeros[b] if b < len(zeros) else None,
                    "target": target, "diff": diff, "delta": delta,
                    "met": (diff <= delta + _TOL) if diff is not None else None,
                    "train_gate_mean": tmean, "train_diff": tdiff,
                    "train_met": (tdiff <= delta + _TOL) if tdiff is not None else None})
    return out


def _block_point_table(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per controlled point and first-half block, the mean gate over seeds (± sample std) on
    validation and on the last training batches, and how many seeds met the target within delta on each."""
    out = ["Mean over seeds (± sample std); `met`: seeds within delta of the target.", "",
           "| point | block | target | val mean gate | met (val) | train mean gate | met (train) |",
           "|---|---|---|---|---|---|---|"]
    groups = by_point(rows)
    for p in points:
        checks = [block_check(r) for r in groups[p["point"]]]
        for b, c0 in enumerate(checks[0]):
            cols = []
            for key, met in (("gate_mean", "met"), ("train_gate_mean", "train_met")):
                judged = [c[b] for c in checks if c[b][key] is not None]  # seeds that have this side's data
                m = _stats([c[key] for c in judged]) if judged else None
                cols.append("-" if m is None else f"{m[0]:.3f} ± {m[1]:.3f}")
                cols.append(f"{sum(bool(c[met]) for c in judged)}/{len(judged)}" if judged else "-")
            out.append(f"| {p['point']} | {b} | {_fmt(c0['target'], '.3f')} | " + " | ".join(cols) + " |")
    return out


def _sort_key(row: dict[str, Any]) -> tuple:
    # Dense by depth, then no control, then the controller sweep from the weakest target (mu_final 1) down.
    order = {KIND_DENSE: 0, KIND_NO_CONTROL: 1, KIND_GATED: 2}
    mu = row.get("mu_final")
    return (order.get(row["kind"], 3), row["n_layers"] if row["kind"] == KIND_DENSE else 0,
            -(mu if mu is not None else 0.0), row["run"])


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec) if spec else str(v)


def _fmt_paired(mean: float, std: float, ci95: float | None, n: int) -> str:
    """Two table cells: the mean difference (± std from two seeds on) and its 95% interval ("-" for one seed)."""
    diff = f"{mean:+.4f}" + ("" if n < 2 else f" ± {std:.4f}")
    return diff + " | " + ("-" if ci95 is None else f"[{mean - ci95:+.4f}, {mean + ci95:+.4f}]")


def _section(title: str, blurb: str, columns: tuple[str, ...], body: list[str]) -> list[str]:
    """A report section: heading, one paragraph, a Markdown table with `columns` and the rows `body`."""
    return [f"## {title}", "", blurb, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *body, ""]


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    """One line per row, `columns` in order, None as an empty cell."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])


def write_table(rows: list[dict[str, Any]], csv_path: Path | str, md_path: Path | str,
                png_name: str | None = None) -> None:
    """Write the runs as CSV (one row each, `CSV_COLUMNS`) and a Markdown report with the per-block
    target check of the gated runs. `png_name`, if given, is linked from the Markdown.

    Long: the Figure-2 report (docs/results/figure2-cpu.md), its sections in reading order; each section is a
    few lines of Markdown over the same rows and points."""
    rows = sorted(rows, key=_sort_key)
    csv_path, md_path = Path(csv_path), Path(md_path)
    for p in (csv_path, md_path):
        p.parent.mkdir(parents=True, exist_ok=True)
    _write_csv(csv_path, CSV_COLUMNS, rows)

    grid = rows[0].get("grid", "") if rows else ""
    lines = [f"# Figure 2 reproduction: sweep `{grid}`", ""]
    if png_name:
        lines += [f"![val CE vs estimated FLOPs and vs sparsity]({png_name})", ""]
    lines += [
        "Estimated FLOPs: one forward pass over one sequence at batch 1, at the measured gate sparsity, assuming "
        "the full benefit of skipped tokens (paper section 3; `midlayer/model/flops.py`). `vs dense-equiv.`: that "
        "estimate over the same model's count at sparsity 0.",
        "",
    ]
    points = aggregate(rows)
    if any(p["seeds"] > 1 for p in points):
        _write_csv(csv_path.with_name(csv_path.stem + "-points.csv"), POINT_COLUMNS, points)
        lines += [
            "## Points: mean over seeds",
            "",
            "val CE: mean ± sample standard deviation over the seeds (min-max in brackets); sparsity and FLOPs: "
            "mean ± std. `targets met`: seeds whose every block is within delta of its target.",
            "",
            "| point | kind | gating | layers | mu_final | seeds | val CE | mean sparsity | est. MFLOPs/seq "
            "| vs dense-equiv. | targets met |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in points:
            one = p["seeds"] < 2  # a single seed has no spread to show: no "± 0" that would read as a measured one
            fl = "-" if p.get("flops_per_seq_mean") is None else (
                f"{p['flops_per_seq_mean'] / 1e6:,.1f}" + ("" if one else f" ± {p['flops_per_seq_std'] / 1e6:,.1f}"))
            ce = (f"{p['val_ce_mean']:.4f}" if one else f"{p['val_ce_mean']:.4f} ± {p['val_ce_std']:.4f} "
                  f"[{p['val_ce_min']:.4f}-{p['val_ce_max']:.4f}]")
            sp = f"{p['mean_sparsity_mean']:.3f}" + ("" if one else f" ± {p['mean_sparsity_std']:.3f}")
            met = f"{p['targets_met']}/{p['seeds']}" if p.get("targets_met") is not None else "-"
            lines.append(f"| {p['point']} | {p['kind']} | {_fmt(p.get('gate_attention'))} | {p['n_layers']} | "
                         f"{_fmt(p.get('mu_final'), '.2f')} | {p['seeds']} | {ce} | {sp} | {fl} | "
                         f"{_fmt(p.get('flops_ratio_mean'), '.3f')} | {met} |")
        lines += ["", "## Runs", ""]
    sect: list[str] = []
    steps = depth_steps(rows)
    if steps:
        sect += _section(
            "Do the dense depths separate?",
            "Per seed: val CE of the deeper model minus that of the shallower one; mean ± sample std over seeds "
            "and the 95% t interval of the mean.",
            ("depths", "seeds", "deeper - shallower", "95% interval", "verdict"),
            [f"| {d['from']} -> {d['to']} | {d['seeds']} | "
             f"{_fmt_paired(d['mean'], d['std'], d['ci95'], d['seeds'])} | {d['verdict']} |" for d in steps])
    gaps = equal_flops_gaps(rows)
    if gaps:
        sect += _section(
            "Gated vs dense at equal estimated FLOPs",
            "Per seed: the gated run's validation CE minus the same seed's dense curve (linear between the two "
            "depths that bracket the gated run's estimated FLOPs); then the mean over seeds ± sample std, and "
            "the 95% t interval of that mean. `verdict`: which side is lower where the interval excludes 0.",
            ("point", "seeds", "est. MFLOPs/seq", "val CE", "dense at equal FLOPs", "gated - dense", "95% interval",
             "seeds gated lower", "verdict"),
            [f"| {g['point']} | {g['seeds']} | {g['flops_per_seq_mean'] / 1e6:,.1f} | "
             f"{g['val_ce_mean']:.4f} | {g['dense_ce_mean']:.4f} | "
             f"{_fmt_paired(g['gap_mean'], g['gap_std'], g['gap_ci95'], g['seeds'])} | "
             f"{g['gated_lower']}/{g['seeds']} | {g['verdict']} |" for g in gaps])
    pooled = pooled_gaps(gaps)
    if pooled:
        sect += _section(
            "All points of one gating index together",
            "Per seed: the mean of that index's gated - dense gaps (table above) over its points, using the seeds "
            "every point has; then the mean over seeds ± sample std and the 95% t interval. One verdict per "
            "indexing: does gating, over the controller settings tried, beat or trail dense models of equal FLOPs?",
            ("gating", "points", "seeds", "mean gap", "95% interval", "verdict"),
            [f"| {p['gate_attention']} | {p['points']} | {p['seeds']} | "
             f"{_fmt_paired(p['mean'], p['std'], p['ci95'], p['seeds'])} | {p['verdict']} |" for p in pooled])
    pairs = gating_differences(gaps)
    if pairs:
        sect += _section(
            "Key- vs query-indexed gating",
            "Eq. 3 as written (`key`: a skipped token is hidden as a key) against the reference code's indexing "
            "(`query`: the log-gate is added to the query's row, which hides nothing), at the same controller "
            "setting. Per seed: the key point's gap to the dense curve minus the query point's (both from the "
            "table above, so at equal estimated FLOPs); mean ± std over seeds and the 95% t interval.",
            ("key point", "query point", "seeds", "key gap - query gap", "95% interval", "verdict"),
            [f"| {d['key']} | {d['query']} | {d['seeds']} | "
             f"{_fmt_paired(d['mean'], d['std'], d['ci95'], d['seeds'])} | {d['verdict']} |" for d in pairs])
    if sect:
        if "## Runs" in lines:
            at = lines.index("## Runs")
            lines[at:at] = sect
        else:
            lines += sect + ["## Runs", ""]
    lines += [
        "| run | kind | layers | mu_final | val CE | val ppl | mean sparsity | est. MFLOPs/seq | vs dense-equiv. "
        "| params | train tok/s | steps | wall (min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mf = r["flops_per_seq"] / 1e6 if r.get("flops_per_seq") is not None else None
        lines.append(f"| {r['run']} | {r['kind']} | {r['n_layers']} | {_fmt(r.get('mu_final'), '.2f')} | "
                     f"{r['val_ce']:.4f} | {_fmt(r.get('val_ppl'), '.2f')} | {_fmt(r.get('mean_sparsity'), '.3f')} | "
                     f"{_fmt(mf, ',.1f')} | {_fmt(r.get('flops_ratio'), '.3f')} | {_fmt(r.get('params'), ',')} | "
                     f"{_fmt(r.get('train_tokens_per_s'), ',.0f')} | {_fmt(r.get('step'))} | "
                     f"{_fmt(r['wall_s'] / 60 if r.get('wall_s') is not None else None, '.1f')} |")
    lines += ["", _wall_summary(rows, grid)]
    gated = [r for r in rows if r["kind"] != KIND_DENSE]
    if gated:
        lines += [
            "",
            "## Did the controller meet its layer-wise targets?",
            "",
            "Per first-half block l (block L-1-l shares its gate): mean gate and sparsity (fraction of gates "
            "exactly 0) at the final evaluation (validation text), against the target mu*_l = linspace(mu0, "
            "mu_final, L/2)[l]; met = |mean gate - mu*_l| <= delta (the controller's dead band). `train`: the "
            "mean gate on the training batches the controller acted on, averaged over the logged steps of the "
            f"last {TRAIN_GATE_WINDOW}. Runs without control have no target.",
            "",
        ]
        controlled = [p for p in aggregate(gated) if p["seeds"] > 1 and p.get("mu_final") is not None]
        if controlled:
            lines += _block_point_table(gated, controlled) + [""]
        lines += [
            "| run | mu0 -> mu_final | block | target mu*_l | mean gate | sparsity | abs diff | met "
            "| train mean gate | train abs diff | met on train |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        summary = []
        for r in gated:
            checks = block_check(r)
            span = (f"{r['mu0']:.2f} -> {r['mu_final']:.2f}" if r.get("mu0") is not None
                    and r.get("mu_final") is not None else "no control")
            for c in checks:
                lines.append(f"| {r['run']} | {span} | {c['block']} | {_fmt(c['target'], '.3f')} | "
                             f"{_fmt(c['gate_mean'], '.3f')} | {_fmt(c['sparsity'], '.3f')} | "
                             f"{_fmt(c['diff'], '.3f')} | {_fmt(c['met'])} | {_fmt(c['train_gate_mean'], '.3f')} | "
                             f"{_fmt(c['train_diff'], '.3f')} | {_fmt(c['train_met'])} |")
            judged = [c["met"] for c in checks if c["met"] is not None]
            if judged:
                judged_t = [c["train_met"] for c in checks if c["train_met"] is not None]
                train = f", {sum(judged_t)}/{len(judged_t)} on training batches" if judged_t else ""
                summary.append(f"- {r['run']}: {sum(judged)}/{len(judged)} blocks within delta = "
                               f"{checks[0]['delta']:g} of their target{train}")
        if summary:
            lines += [""] + summary
    md_path.write_text("\n".join(lines) + "\n")


def _label(row: dict[str, Any]) -> str:
    if row["kind"] == KIND_DENSE:
        return f"{row['n_layers']}L"
    if row["kind"] == KIND_NO_CONTROL:
        return "no control"
    return rf"$\mu^*$={row['mu_final']:.2f}" if row.get("mu_final") is not None else row.get("point", row.get("run"))


def plot_figure2(rows: list[dict[str, Any]], png_path: Path | str, title: str | None = None) -> None:
    """Left: val CE vs estimated forward FLOPs per sequence; right: val CE vs mean sparsity. Dense runs are
    a line labelled by depth, gated runs separate points labelled by mu_final or "no control"; key- and
    query-indexed gating get their own markers. Runs that differ only in seed are one point at their mean,
    with error bars of one sample standard deviation (`aggregate`)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'midlayer[plot]'") from e
    if not rows:
        raise ValueError("nothing to plot: no run has a final evaluation")
    points = aggregate(rows)
    dense = sorted((p for p in points if p["kind"] == KIND_DENSE), key=lambda p: p["n_layers"])
    seeds = max(p["seeds"] for p in points)

    # Figure + Agg canvas directly (not pyplot): no global backend state, works headless and in threads.
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_f, ax_s = fig.subplots(1, 2, sharey=True)

    def annotate(ax, x: float, y: float, text: str) -> None:
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)

    def draw(ax, ps: list[dict[str, Any]], xkey: str, scale: float, fmt: str, color: str, label: str | None) -> None:
        xs = [(p[f"{xkey}_mean"] or 0.0) * scale for p in ps]
        xerr = [(p.get(f"{xkey}_std") or 0.0) * scale for p in ps]
        ys, yerr = [p["val_ce_mean"] for p in ps], [p["val_ce_std"] for p in ps]
        ax.errorbar(xs, ys, yerr=yerr, xerr=xerr, fmt=fmt, color=color, label=label, capsize=2, markersize=5)
        for p, x, y in zip(ps, xs, ys):
            annotate(ax, x, y, _label(p))

    series = []
    modes = sorted({p.get("gate_attention") or "key" for p in points if p["kind"] != KIND_DENSE})
    for i, mode in enumerate(modes):
        tag = "" if modes == ["key"] else f", {mode} gating"
        ctrl = sorted((p for p in points if p["kind"] == KIND_GATED and (p.get("gate_attention") or "key") == mode),
                      key=lambda p: -(p.get("mu_final") or 0.0))
        free = [p for p in points if p["kind"] == KIND_NO_CONTROL and (p.get("gate_attention") or "key") == mode]
        if ctrl:
            series.append((ctrl, "D^"[i % 2], ("C1", "C3")[i % 2], f"gated {ctrl[0]['n_layers']}L, controlled{tag}"))
        if free:
            series.append((free, "sv"[i % 2], ("C2", "C4")[i % 2], f"gated {free[0]['n_layers']}L, no control{tag}"))
    for ax, xkey, scale in ((ax_f, "flops_per_seq", 1e-9), (ax_s, "mean_sparsity", 1.0)):
        if dense:
            # A line through the depths on the FLOPs axis; on the sparsity axis they all sit at 0.
            draw(ax, dense, xkey, scale, "o-" if ax is ax_f else "o", "C0", "dense baselines")
        for ps, marker, color, label in series:
            draw(ax, ps, xkey, scale, marker, color, label)
        ax.grid(True, alpha=0.3)
    ax_f.set_xlabel("estimated forward GFLOPs per sequence")
    ax_s.set_xlabel("mean gate sparsity")
    # points may have fewer seeds than the most seeded one (a sweep in progress): say so, not "N seeds"
    ax_f.set_ylabel("validation cross-entropy")
    ax_f.legend(fontsize=8)
    grid = title if title is not None else rows[0].get("grid", "")
    # the seeds note in the title, not the y label, whose length the figure's height cuts off
    fig.suptitle((f"Figure 2 reproduction ({grid})" if grid else "Figure 2 reproduction")
                 + ("" if seeds < 2 else f": mean ± std over up to {seeds} seeds (one-seed points: no bar)"))
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=150)


# ============================================================================ the parts ablation (issue 13)
def collect_parts(sweep_dir: Path | str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per part of a `parts` sweep, aggregated over its seeds; one row per stability run).

    A run `<part>-s<seed>` contributes its eval.json (val CE, params, active params, FLOPs per sequence,
    training tokens/s) and extrapolation.json (CE at longer contexts); `<placement>-lr<k>x-s0` runs are the
    stability rows, `diverged` when sweep.json (or the run's own log) says so.

    Training speed: from `throughput.json` in the sweep folder when present (benchmarks/parts_throughput.py,
    every part timed interleaved on a quiet machine; `speed_vs_baseline` is its same-round ratio), else the
    runs' own tokens/s (measured hours apart, often beside other jobs: `speed_source` says which)."""
    sweep_dir = Path(sweep_dir)
    sweep = _read_json(sweep_dir / "sweep.json")
    runs = _sweep_runs(sweep if isinstance(sweep, dict) else None)
    status = {r.get("name"): r.get("status") for r in runs}
    names = [r["name"] for r in runs if isinstance(r.get("name"), str)] or \
        sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    parts: dict[str, list[dict[str, Any]]] = {}
    stability: list[dict[str, Any]] = []
    for name in names:
        run = sweep_dir / name
        res = _read_json(run / "eval.json")
        res = res if isinstance(res, dict) else {}
        ext = _read_json(run / "extrapolation.json")
        ext = (ext.get("val_ce") if isinstance(ext, dict) else None) or {}
        gone = status.get(name) == "diverged" or diverged(run)
        if "-lr" in name:
            if res.get("val_ce") is None and not gone:
                continue  # not finished yet
            placement, rest = name.split("-lr", 1)
            stability.append({"placement": placement, "lr_multiple": int(rest.split("x")[0]),
                              "val_ce": None if gone else res.get("val_ce"), "diverged": gone})
            continue
        part = point_name(name)
        if res.get("val_ce") is None and not gone:
            continue  # not finished yet
        ce = res.get("val_ce")
        if not gone and (isinstance(ce, bool) or not isinstance(ce, (int, float)) or not math.isfinite(ce)):
            print(f"plot: {name}: its final val_ce is {ce!r}, left out", file=sys.stderr)  # (was a TypeError)
            continue
        seq = res.get("seq_len")
        # the current cost model from the run's config, as `collect` does (eval.json's FLOPs are of its day)
        cost = estimated_costs((_read_json(run / "config.json") or {}).get("model") or {}, res)
        parts.setdefault(part, []).append({
            "val_ce": None if gone else ce, "diverged": gone, "params": res.get("params"),
            "active_params": cost["active_params"], "tokens_per_s": res.get("train_tokens_per_s"),
            "flops_per_token": cost["flops_per_seq"] / seq if cost["flops_per_seq"] and seq else None,
            "ext": ext, "seq_len": seq})
    # lr x 1 of the stability curves: the placement's own seed-0 run in the grid (PARTS_PLACEMENT_PART)
    for placement, part in PARTS_PLACEMENT_PART.items():
        run = sweep_dir / f"{part}-s0"
        res = _read_json(run / "eval.json") or {}
        gone = status.get(run.name) == "diverged" or diverged(run)
        if any(r["placement"] == placement for r in stability) and (gone or res.get("val_ce") is not None):
            stability.append({"placement": placement, "lr_multiple": 1,
                              "val_ce": None if gone else res.get("val_ce"), "diverged": gone})
    rows = [_part_row(part, runs) for part, runs in parts.items()]
    base = next((r["val_ce"] for r in rows if r["part"] == "baseline"), None)
    for r in rows:
        r["delta"] = None if base is None or r["val_ce"] is None else r["val_ce"] - base
    bench = (_read_json(sweep_dir / "throughput.json") or {}).get("parts") or {}
    base_speed = next((r["tokens_per_s"] for r in rows if r["part"] == "baseline"), None)
    for r in rows:
        timed = bench.get(r["part"])
        if isinstance(timed, dict) and timed.get("tokens_per_s") is not None:
            r.update(tokens_per_s=timed["tokens_per_s"], speed_vs_baseline=timed.get("speed_vs_baseline"),
                     speed_source="benchmark")
        else:
            r.update(speed_vs_baseline=None if not base_speed or r["tokens_per_s"] is None
                     else r["tokens_per_s"] / base_speed, speed_source="runs")
    return rows, stability


def _part_row(part: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A part's row of the table from its seeds' runs: mean val CE and its spread (max - min), mean params,
    FLOPs and throughput, and the mean CE at 2x and 4x the training context."""
    ces = [r["val_ce"] for r in runs if r["val_ce"] is not None]
    seq = next((r["seq_len"] for r in runs if r["seq_len"]), None)
    row: dict[str, Any] = {"part": part, "seeds": len(runs), "diverged": sum(r["diverged"] for r in runs),
                           "val_ce": sum(ces) / len(ces) if ces else None,
                           "spread": max(ces) - min(ces) if len(ces) > 1 else None}
    for key in ("params", "active_params", "flops_per_token", "tokens_per_s"):
        vals = [r[key] for r in runs if r[key] is not None]
        row[key] = sum(vals) / len(vals) if vals else None
    for m in (2, 4):
        vals = [r["ext"].get(str(seq * m)) for r in runs if seq and r["ext"].get(str(seq * m)) is not None]
        row[f"val_ce_x{m}"] = sum(vals) / len(vals) if vals else None
    return row


def write_parts_report(sweep_dir: Path | str, prefix: Path | str) -> dict[str, Path]:
    """The parts table (Markdown, CSV) and a bar chart of each part's CE difference to the baseline (PNG).

    Long: one report (docs/results/parts-cpu.md) written top to bottom, each section from the rows collected
    above; split into functions it would pass the same dozen values to each."""
    rows, stability = collect_parts(sweep_dir)
    if not rows:
        raise ValueError(f"{sweep_dir}: no run of the parts grid has finished yet")
    prefix = Path(prefix)
    paths = {"csv": prefix.with_name(prefix.name + ".csv"), "md": prefix.with_name(prefix.name + ".md"),
             "png": prefix.with_name(prefix.name + ".png")}
    paths["md"].parent.mkdir(parents=True, exist_ok=True)
    cols = ("part", "seeds", "val_ce", "spread", "delta", "val_ce_x2", "val_ce_x4", "params", "active_params",
            "flops_per_token", "tokens_per_s", "speed_vs_baseline", "speed_source", "diverged")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in cols})
    timed = all(r["speed_source"] == "benchmark" for r in rows)
    lines = [("Training speed: benchmarks/parts_throughput.py (every part interleaved on a quiet machine; speed is "
              "the median same-round ratio to the baseline)." if timed else
              "Training speed: each run's own tokens/s, measured hours apart and often beside other jobs (rough; "
              "benchmarks/parts_throughput.py times every part together; '(bench)' marks its numbers)."), "",
             "| part | seeds | val CE (mean) | spread | vs baseline | CE at 2x context | CE at 4x context | params | "
             "active params | FLOPs/token | train tok/s | speed vs baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['part']} | {r['seeds']}{' (' + str(r['diverged']) + ' diverged)' if r['diverged'] else ''}"
                     f" | {_fmt(r['val_ce'], '.4f')} | {_fmt(r['spread'], '.4f')} | {_fmt(r['delta'], '+.4f')} | "
                     f"{_fmt(r['val_ce_x2'], '.3f')} | {_fmt(r['val_ce_x4'], '.3f')} | {_fmt(r['params'], ',.0f')} | "
                     f"{_fmt(r['active_params'], ',.0f')} | {_fmt(r['flops_per_token'], ',.0f')} | "
                     f"{_fmt(r['tokens_per_s'], ',.0f')}{' (bench)' if r['speed_source'] == 'benchmark' and not timed else ''}"
                     f" | {_fmt(r['speed_vs_baseline'], '.2f')} |")
    if stability:
        lines += ["", "Stability (seed 0): validation CE, or diverged, at multiples of the baseline lr.", "",
                  "| placement | lr x | val CE |", "|---|---|---|"]
        for r in sorted(stability, key=lambda r: (r["placement"], r["lr_multiple"])):
            lines.append(f"| {r['placement']} | {r['lr_multiple']} | "
                         f"{'diverged' if r['diverged'] else _fmt(r['val_ce'], '.4f')} |")
    lines += ["", f"![CE difference to the baseline per part]({paths['png'].name})"]
    paths["md"].write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"{e} (the tables {paths['csv']} and {paths['md']} were written)") from e
    shown = [r for r in rows if r["delta"] is not None]
    fig, axes = plt.subplots(1, 3, figsize=(17, 0.3 * len(shown) + 1.6), width_ratios=(1.3, 1, 1))
    ax = axes[0]
    ax.barh([r["part"] for r in shown], [r["delta"] for r in shown],
            xerr=[(r["spread"] or 0.0) / 2 for r in shown], color=["#4477aa" if r["delta"] <= 0 else "#cc6677"
                                                                   for r in shown])
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("validation CE minus the baseline's\n(lower is better; bars: half the seed spread)")
    # CE against parameters: every part at its total count (hollow); where only some parameters work per token
    # (MoE), also at its active count (filled), joined to its total -- the issue's "CE against active and total".
    ax = axes[1]
    pts = [r for r in shown if r["params"]]
    ax.scatter([r["params"] / 1e6 for r in pts], [r["val_ce"] for r in pts], facecolors="none",
               edgecolors="#4477aa", label="total parameters")
    sparse = [r for r in pts if r["active_params"] and r["active_params"] < r["params"]]
    for r in sparse:
        ax.plot([r["active_params"] / 1e6, r["params"] / 1e6], [r["val_ce"]] * 2, color="#cc6677", linewidth=0.8)
        ax.annotate(r["part"], (r["params"] / 1e6, r["val_ce"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    if sparse:
        ax.scatter([r["active_params"] / 1e6 for r in sparse], [r["val_ce"] for r in sparse], color="#cc6677",
                   label="active parameters (MoE)")
    base = next((r for r in pts if r["part"] == "baseline"), None)
    if base:
        ax.annotate("baseline", (base["params"] / 1e6, base["val_ce"]), fontsize=7, xytext=(3, -9),
                    textcoords="offset points")
        for r in pts:  # name the parts that change the parameter count (the others sit on the baseline's)
            if r not in sparse and abs(r["params"] - base["params"]) > 0.01 * base["params"]:
                ax.annotate(r["part"], (r["params"] / 1e6, r["val_ce"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("validation CE (mean over seeds)")
    ax.legend(fontsize=8)
    # Stability: CE against lr multiple per norm placement; a diverged run is drawn as an x on the top edge.
    ax = axes[2]
    if stability:
        finite = [r["val_ce"] for r in stability if r["val_ce"] is not None]
        top = max(finite) + 0.1 if finite else 1.0
        for i, placement in enumerate(sorted({r["placement"] for r in stability})):
            curve = sorted((r for r in stability if r["placement"] == placement), key=lambda r: r["lr_multiple"])
            color = ("#4477aa", "#cc6677", "#228833", "#aa3377")[i % 4]
            ok = [r for r in curve if not r["diverged"] and r["val_ce"] is not None]
            ax.plot([r["lr_multiple"] for r in ok], [r["val_ce"] for r in ok], "o-", color=color, label=placement)
            bad = [r for r in curve if r["diverged"]]
            if bad:
                ax.plot([r["lr_multiple"] for r in bad], [top] * len(bad), "x", color=color, markersize=10,
                        label=f"{placement}: diverged")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate / the baseline's (seed 0)")
        ax.set_ylabel("validation CE")
        ax.legend(fontsize=8)
    else:
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=120)
    plt.close(fig)
    return paths


def write_report(sweep_dir: Path | str, prefix: Path | str | None = None) -> dict[str, Path]:
    """collect + write_table + plot_figure2 into PREFIX.csv/.md/.png (default SWEEP_DIR/figure2: a default in
    docs/results replaced its committed, hand-written pages). The tables are written before the figure, so they
    exist even without matplotlib. A `parts` sweep gets its own table and plot (`write_parts_report`, default
    SWEEP_DIR/parts-table). A sweep.json that is not a sweep's, or that is missing or unreadable beside runs that
    are not a Figure-2 grid's, is a ValueError (a parts sweep was reported as a Figure-2 one)."""
    sweep_dir = Path(sweep_dir)
    sweep = _read_json(sweep_dir / "sweep.json")
    if (sweep_dir / "sweep.json").exists() and not (isinstance(sweep, dict)
                                                    and isinstance(sweep.get("grid", ""), str)):
        raise ValueError(f"{sweep_dir / 'sweep.json'}: not a sweep's record (a JSON object with a grid name); "
                         "restore it, or remove it to plot the runs' own files")
    grid = (sweep or {}).get("grid", "")
    if grid.startswith("parts"):
        return write_parts_report(sweep_dir, prefix or sweep_dir / "parts-table")
    rows = collect(sweep_dir)
    if not rows:
        raise ValueError(f"{sweep_dir}: no run has a final evaluation (eval.json with val_ce) yet")
    if not grid and not any(r["kind"] == KIND_DENSE and r["run"].startswith("dense-") for r in rows):
        raise ValueError(f"{sweep_dir}: no sweep.json says what sweep this is, and its runs are no Figure-2 grid's "
                         "(no dense-N run); a parts sweep needs its sweep.json")
    prefix = Path(prefix) if prefix is not None else sweep_dir / "figure2"
    paths = {"csv": prefix.with_name(prefix.name + ".csv"), "md": prefix.with_name(prefix.name + ".md"),
             "png": prefix.with_name(prefix.name + ".png")}
    write_table(rows, paths["csv"], paths["md"], png_name=paths["png"].name)
    try:
        plot_figure2(rows, paths["png"])
    except ImportError as e:
        raise ImportError(f"{e} (the tables {paths['csv']} and {paths['md']} were written)") from e
    return paths


__all__ = ["collect", "aggregate", "dense_at", "equal_flops_gaps", "depth_steps", "paired_difference", "point_name", "write_table", "plot_figure2", "block_targets", "block_check",
           "write_report", "POINT_COLUMNS",
           "collect_parts", "write_parts_report", "CSV_COLUMNS"]

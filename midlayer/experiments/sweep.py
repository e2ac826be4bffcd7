"""Figure-2 sweeps: named grids of runs, run one after another, restartable.

The paper's Figure 2 (Lawson & Aitchison, arXiv 2506.21103) compares, at one width and one token budget,
dense baselines of increasing depth with a gated model trained without sparsity control and with the
proportional controller at several final targets mu*_{L/2-1} (mu*_0 = 1). A grid (`GRIDS`) is that list of
runs as data: each `RunSpec` is a preset plus per-section overrides, and `Grid.shared_train` (steps, batch,
sequence length, seed, data) is applied to every run so that all runs see the same tokens.

`run_sweep` trains the runs into `<out_root>/<grid>/<run>/`, one after another:

* a run whose `eval.json` says `finished` at the run's step count is skipped;
* a run with checkpoints but no finished evaluation is resumed (`resume=True`);
* anything else is started from scratch.

So a killed sweep is continued by running the same command again. A failing run is reported and the sweep
goes on with the next one; the return value is nonzero if any run failed. `<out_root>/<grid>/sweep.json`
records every run's action, status and wall time (rewritten atomically after each change).

    midlayer sweep cpu                       # ~90 minutes on 2 CPU cores
    midlayer sweep paper --launcher torchrun --nproc 8 --data 'data/fineweb10B/fineweb_*.bin'
    midlayer sweep cpu-seeds --out-dir sweeps   # the three-seed grid, ~9 h on 2 CPU cores, resumable
    midlayer plot sweeps/cpu-seeds --out docs/results/figure2-cpu   # -> docs/results/figure2-cpu.{png,csv,md}
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from midlayer.common import atomic_write
from midlayer.config import get_preset, ModelConfig, SparsityConfig, TrainConfig
from midlayer.ops.kernels import cpu_info
from midlayer.output_lock import OutputLock
from midlayer.train.checkpoint import config_mismatch, list_checkpoints
from midlayer.train.evaluate import evaluate_contexts, rescalable_rope
from midlayer.train.loop import FREE_ON_RESUME, RECOVERY_ON_RESUME, train

SECTION_CLASSES: dict[str, type] = {"model": ModelConfig, "sparsity": SparsityConfig, "train": TrainConfig}
LAUNCHERS = ("inline", "torchrun")

# The three kinds of run in Figure 2; `midlayer.experiments.plot` draws each differently.
KIND_DENSE = "dense"
KIND_GATED = "gated"
KIND_NO_CONTROL = "gated-no-control"


@dataclass(frozen=True)
class RunSpec:
    """One run of a grid: a preset plus overrides of its model / sparsity / train sections."""

    name: str
    preset: str
    model: dict[str, Any] = field(default_factory=dict)
    sparsity: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grid:
    """A named list of runs. `shared_train` is applied to every run (after the run's own train overrides,
    so a run cannot silently change the token budget, data or seed that the comparison depends on)."""

    name: str
    description: str
    runs: tuple[RunSpec, ...]
    shared_train: dict[str, Any] = field(default_factory=dict)
    # The paper grid needs real shards; refuse up front rather than fail every run the same way.
    requires_data_glob: bool = False
    # What every run must share for the comparison to mean anything (`check_grid`); None: Figure 2's.
    shared_model_fields: tuple[str, ...] | None = None
    shared_train_fields: tuple[str, ...] | None = None
    # Validation CE also at these multiples of the training context (`extrapolation.json`; length
    # extrapolation of the position schemes), evaluated once the run is finished.
    eval_context_multiples: tuple[int, ...] = ()
    # A non-finite loss is a result here (the stability runs): recorded as "diverged", not a failure.
    divergence_is_a_result: bool = False

    def run(self, name: str) -> RunSpec:
        for r in self.runs:
            if r.name == name:
                return r
        raise ValueError(f"grid {self.name!r} has no run {name!r}; runs: {', '.join(r.name for r in self.runs)}")


def _figure2_runs(dense_presets: list[tuple[int, str]], gated_preset: str, mu_finals: list[float],
                  dense_model: dict[str, Any] | None = None,
                  gated_model: dict[str, Any] | None = None) -> tuple[RunSpec, ...]:
    """Dense baselines (depth, preset), the gated model without control, then the controller sweep."""
    runs = [RunSpec(f"dense-{n}", preset, model={"n_layers": n, "gating": False, **(dense_model or {})})
            for n, preset in dense_presets]
    gm = {"gating": True, **(gated_model or {})}
    runs.append(RunSpec("gated-none", gated_preset, model=dict(gm), sparsity={"controller": "none"}))
    for mu in mu_finals:
        runs.append(RunSpec(f"gated-mu{mu:.2f}", gated_preset, model=dict(gm),
                            sparsity={"controller": "proportional", "mu0": 1.0, "mu_final": mu}))
    return tuple(runs)


# ---- cpu: the tiny width (dim 128, 4 heads, vocab 4096, seq 256, batch 16 x 256 = 4096 tokens/step,
# lr 3e-3), a 6-layer gated model standing in for the paper's 12-layer one, dense baselines at 1..6 layers.
#
# Time budget (2 cores, fp32), measured: gated 6 layers ~6,400 tok/s (156 us/token), dense 6 layers
# ~7,500 tok/s (133 us/token). A dense model's cost per token is modelled as fixed + L * per_block. The
# fixed part (embedding, the 128 x 4096 head, softmax cross-entropy over 4096 logits, AdamW on the ~1.05M
# embedding/head parameters) is ~23% of the 6-layer forward FLOPs (flops.py: head 1.05 of 4.64 MFLOP/token);
# a rough back-to-back timing of dense 1 vs 6 layers (on a busy machine) put dense-1 at 0.2-0.3x dense-6,
# i.e. fixed ~20%. We budget with a pessimistic fixed ~40 us/token (30%), per_block ~15.6 us/token:
#   dense 1..6: 55.6 + 71.1 + 86.7 + 102.2 + 117.8 + 133.3 = 567 us/token   (fixed 20%: 526)
#   gated x5 (no control + 4 targets; sparsity saves no wall time in training): 5 x 156 = 781 us/token
#   all 11 runs: ~1,348 us per token of the per-run budget                   (fixed 20%: 1,307)
# Training: 800 steps x 4,096 tokens = 3.28M tokens per run (~2.2 passes over the 1.49M-token
#   Shakespeare training split) -> 3.28M x 1,348 us = 4,417 s = 73.6 min        (fixed 20%: 71.4 min).
# Evaluation: 200k tokens requested (the split holds ~163k; the evaluator stops there), forward only,
#   ~1/3 of a training token: 11 runs x 200k x 122 us / 3 ~ 90 s = 1.5 min.
# Start-up + 8 checkpoints per run (~30 MB each): ~5 s x 11 ~ 1 min.
# Total ~76 min on an otherwise idle machine (~74 min if fixed is 20%); the margin to 90 min absorbs a
# busy machine (the real run's wall time is recorded in docs/skip-middle.md).
CPU_STEPS = 800
CPU_MU_FINALS = [0.75, 0.5, 0.25, 0.0]
_CPU = Grid(
    name="cpu",
    description="tiny width on 2 CPU cores (~90 min): dense 1..6 layers, 6-layer gated without control and "
                "with the proportional controller, mu0 = 1, mu_final in 0.75, 0.5, 0.25, 0",
    runs=_figure2_runs([(n, "tiny-dense") for n in range(1, 7)], "tiny", CPU_MU_FINALS,
                       gated_model={"n_layers": 6}),
    shared_train=dict(steps=CPU_STEPS, batch_size=16, micro_batch_size=16, seq_len=256, lr=3e-3, seed=0,
                      data="shakespeare", eval_tokens=200_000, ckpt_every=100, log_every=20),
)

# ---- smoke: the same structure at the `debug` width and a few steps, for tests and quick checks.
_SMOKE = Grid(
    name="smoke",
    description="debug width, a few steps: dense 1, 2, 4 layers, 4-layer gated without control and with "
                "mu_final 0.5 and 0 (for tests)",
    runs=_figure2_runs([(n, "debug") for n in (1, 2, 4)], "debug", [0.5, 0.0], gated_model={"n_layers": 4}),
    shared_train=dict(steps=4, batch_size=4, micro_batch_size=2, seq_len=32, seed=0, data="shakespeare",
                      eval_tokens=1024, ckpt_every=2, log_every=2),
)

# ---- paper: Table 2 sizes (GPT-2-small width, 12-layer gated, dense 2..12), FineWeb shards, the presets'
# 10B-token budget. The paper sweeps mu_final from 1 down to 0; the five points here are our choice.
PAPER_MU_FINALS = [1.0, 0.75, 0.5, 0.25, 0.0]
PAPER_DATA = "data/fineweb10B/fineweb_*.bin"
_PAPER = Grid(
    name="paper",
    description="paper Table 2 on FineWeb (10B tokens per run; for GPUs): dense 2..12 layers, 12-layer gated "
                "without control and with mu_final in 1, 0.75, 0.5, 0.25, 0",
    runs=_figure2_runs([(n, f"paper-dense-{n}") for n in range(2, 13)], "paper-12l", PAPER_MU_FINALS),
    # A checkpoint every 1000 of the 19,073 steps, so a preempted GPU job loses at most ~5% of a run.
    shared_train=dict(data=PAPER_DATA, seed=0, ckpt_every=1000),
    requires_data_glob=True,
)

# ---- parts (issue 13): from the `tiny-dense` baseline (RMSNorm, sandwich norm, RoPE, SwiGLU, MHA), one part
# changed at a time, two seeds each, at equal training tokens; where a part changes the parameter count the
# run compensates (plain MLPs get a 1.5x wider hidden layer, the GLUs' third matrix). The context is 256
# tokens in training and the models are built for 1024, so every position scheme is also evaluated at 2x and
# 4x its training context (learned positions there use rows never trained: that is the test). Stability:
# pre-, post- and sandwich LN at 3x and 10x the baseline's lr, seed 0, diverged runs recorded as such.
# Time: 300 steps x 4,096 tokens = 1.2M tokens per run. Measured on the AMD EPYC (Zen 2) 2-core machine:
# ~1.15 s per step (the first run, baseline-s0), ~6.5 min per run with the 1x/2x/4x evaluations; 62 runs
# (28 parts x 2 seeds + 6 stability runs) ~6.5 h: several sittings, resumable (a finished run is skipped).
PARTS_STEPS = 300
PARTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("baseline", {}),
    ("layernorm", {"norm_type": "layernorm"}),
    ("layernorm-nobias", {"norm_type": "layernorm_nobias"}),
    ("pre-ln", {"norm_placement": "pre"}),
    ("post-ln", {"norm_placement": "post"}),
    ("qk-norm", {"qk_norm": True}),
    ("nope", {"pos_encoding": "none"}),
    ("sinusoidal", {"pos_encoding": "sinusoidal"}),
    ("learned-pos", {"pos_encoding": "learned"}),
    # The 2017 Transformer scales its token embeddings by sqrt(d_model) (Vaswani et al. sec. 3.4). Without that,
    # N(0, 0.02) token rows are ~1/35 of the sinusoid table's RMS, and the embedding RMSNorm that follows leaves
    # mostly position: "sinusoidal" above measures that handicap, these two the scheme as published, and the
    # scale alone on the RoPE baseline.
    ("sinusoidal-scaled", {"pos_encoding": "sinusoidal", "scale_embeddings": True}),
    ("emb-scaled", {"scale_embeddings": True}),
    ("alibi", {"pos_encoding": "alibi"}),
    ("t5-bias", {"pos_encoding": "t5"}),
    ("rope-ntk4", {"rope_scaling": "ntk", "rope_scale": 4.0}),
    ("geglu", {"ffn_type": "geglu"}),
    ("reglu", {"ffn_type": "reglu"}),
    ("relu-mlp", {"ffn_type": "relu", "ffn_dim_multiplier": 6.0}),
    ("gelu-mlp", {"ffn_type": "gelu", "ffn_dim_multiplier": 6.0}),
    ("silu-mlp", {"ffn_type": "silu", "ffn_dim_multiplier": 6.0}),
    ("gqa-2", {"n_kv_heads": 2}),
    ("mqa", {"n_kv_heads": 1}),
    ("swa-64", {"sliding_window": 64}),
    ("dropout-0.1", {"dropout": 0.1, "attn_dropout": 0.1, "emb_dropout": 0.1}),
    ("tied-embeddings", {"tie_embeddings": True}),
    ("scaled-init", {"init_scheme": "scaled_residual"}),
    ("moe-4-top2", {"moe_experts": 4, "moe_top_k": 2}),
    ("moe-4-top1", {"moe_experts": 4, "moe_top_k": 1}),
    ("ssm-hybrid", {"ssm_layers": (2, 3)}),  # the two middle blocks' attention replaced by a selective SSM
)
PARTS_LR_MULTIPLES = (3, 10)
PARTS_SEEDS = (0, 1)
# The stability runs at 1x the lr are the seed-0 runs of these parts (same config, same seed): not run twice.
PARTS_PLACEMENT_PART = {"sandwich": "baseline", "pre": "pre-ln", "post": "post-ln"}


def _parts_runs(preset: str, parts: tuple[tuple[str, dict[str, Any]], ...], seeds: tuple[int, ...],
                lr: float, lr_multiples: tuple[int, ...], model: dict[str, Any]) -> tuple[RunSpec, ...]:
    runs = [RunSpec(f"{name}-s{seed}", preset, model={**model, **over}, train={"seed": seed})
            for name, over in parts for seed in seeds]
    for placement in ("sandwich", "pre", "post"):
        for k in lr_multiples:
            runs.append(RunSpec(f"{placement}-lr{k}x-s0", preset, model={**model, "norm_placement": placement},
                                train={"seed": 0, "lr": lr * k}))
    return tuple(runs)


_PARTS_TRAIN = dict(steps=PARTS_STEPS, batch_size=16, micro_batch_size=16, seq_len=256, data="shakespeare",
                    eval_tokens=200_000, ckpt_every=100, log_every=20)
_PARTS_GRID_COMMON = dict(shared_model_fields=("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"),
                          shared_train_fields=("steps", "batch_size", "seq_len", "data", "val_data",
                                               "tokenizer_vocab", "eval_tokens"),
                          divergence_is_a_result=True)
_PARTS = Grid(
    name="parts",
    description="issue 13: tiny-dense with one part changed at a time, 2 seeds, 300 steps each, evaluated at "
                "1x/2x/4x the training context; post/pre/sandwich LN at 3x and 10x the lr (~6.5 h on 2 cores)",
    runs=_parts_runs("tiny-dense", PARTS, PARTS_SEEDS, 3e-3, PARTS_LR_MULTIPLES, {"max_seq_len": 1024}),
    shared_train=_PARTS_TRAIN, eval_context_multiples=(2, 4), **_PARTS_GRID_COMMON,
)
_PARTS_SMOKE = Grid(
    name="parts-smoke",
    description="the parts grid's machinery at the debug width, a few steps (for tests)",
    runs=_parts_runs("debug", (("baseline", {}), ("alibi", {"pos_encoding": "alibi"}),
                               ("relu-mlp", {"ffn_type": "relu"})), (0, 1), 1e-3, (10,),
                     {"max_seq_len": 128, "gating": False}),
    shared_train=dict(steps=3, batch_size=4, micro_batch_size=2, seq_len=32, data="shakespeare",
                      eval_tokens=1024, ckpt_every=3, log_every=1),
    eval_context_multiples=(2, 4), **_PARTS_GRID_COMMON,
)

# ---- cpu-seeds (issue 14): the cpu grid's Figure 2 made readable -- three seeds per point (mean and spread),
# a longer budget, and every gated point twice: key-indexed gating (eq. 3, our default) and the public reference
# code's query-indexed variant (a softmax-row constant: skipped tokens stay visible as keys). The controlled
# runs use the controller setting chosen by the issue-14 study (docs/results/controller-cpu.md, items 9-12):
# the paper's rule (eq. 6) with gamma 1e-2 (1e-3 is too slow for ~1,000 steps), a proportional term kp 1, and
# the regulariser differentiated straight through only where that leads a saturated gate back into (0, 1)
# ("straight_through_inward"): at 800 steps it held block 0 at its target of 1.0 (0.997) with no cost in CE
# (4.0985, within the controlled runs' 4.096-4.117), blocks 1-2 within 1-3 deltas; and (item 13, 16th session)
# the variance coefficient's integral term bounded, |beta| <= 0.1 (`beta_max`, anti-windup; kp's term comes on
# top): with it seed 0 of gated-key-mu0.50 meets every block's target within delta on validation text
# (1.000 / 0.743 / 0.491), where the unbounded integrator left block 1 at 0.718. The first two gated runs of
# seed 0 (gated-key-mu0.75/0.50-s0) were trained unbounded and then retrained; the unbounded gated-key-mu0.50-s0
# is kept as cpu-noise's reference.
# Time (2 cores, the cpu grid's per-token costs): per seed, dense 1..6 ~567 us/token and 8 gated runs x
# ~156 us/token, x SEEDS_STEPS x 4,096 tokens; ~2.5 h per seed at 1,200 steps, ~7.5 h in all. Measured: seed 0 took
# 3.1 h of run wall time (AMD EPYC, 2 threads, sometimes beside other jobs), ~9 h in all: several sittings.
SEEDS_STEPS = 1200
SEEDS = (0, 1, 2)
SEEDS_GAMMA = 1e-2
SEEDS_KP = 1.0
SEEDS_REG_GRAD = "straight_through_inward"
SEEDS_BETA_MAX = 0.1
SEEDS_KEY_MU_FINALS = [0.75, 0.5, 0.25, 0.0]
SEEDS_QUERY_MU_FINALS = [0.5, 0.0]


def _seeds_runs(seeds: tuple[int, ...]) -> tuple[RunSpec, ...]:
    """dense-<L>-s<k>, gated-<key|query>-<none|muX>-s<k>: one point per name without its seed suffix."""
    points = [RunSpec(f"dense-{n}", "tiny-dense", model={"n_layers": n, "gating": False}) for n in range(1, 7)]
    for mode, mus in (("key", SEEDS_KEY_MU_FINALS), ("query", SEEDS_QUERY_MU_FINALS)):
        gm = {"gating": True, "n_layers": 6, "gate_attention": mode}
        points.append(RunSpec(f"gated-{mode}-none", "tiny", model=dict(gm), sparsity={"controller": "none"}))
        for mu in mus:
            points.append(RunSpec(f"gated-{mode}-mu{mu:.2f}", "tiny", model=dict(gm),
                                  sparsity={"controller": "proportional", "mu0": 1.0, "mu_final": mu,
                                            "gamma": SEEDS_GAMMA, "kp": SEEDS_KP,
                                            "reg_grad": SEEDS_REG_GRAD, "beta_max": SEEDS_BETA_MAX}))
    return tuple(dataclasses.replace(p, name=f"{p.name}-s{seed}", train={**p.train, "seed": seed})
                 for seed in seeds for p in points)


_SEEDS_TRAIN = dict(steps=SEEDS_STEPS, batch_size=16, micro_batch_size=16, seq_len=256, lr=3e-3, data="shakespeare",
                    eval_tokens=200_000, ckpt_every=100, log_every=10)
_SEEDS_FIELDS = dict(shared_train_fields=("steps", "batch_size", "seq_len", "data", "val_data", "tokenizer_vocab",
                                          "eval_tokens"))
_CPU_SEEDS = Grid(
    name="cpu-seeds",
    description=f"issue 14: the cpu grid with seeds {SEEDS}, {SEEDS_STEPS} steps, gated points with key- and "
                f"query-indexed gating, controller gamma {SEEDS_GAMMA:g} kp {SEEDS_KP:g} reg_grad {SEEDS_REG_GRAD} "
                f"beta_max {SEEDS_BETA_MAX:g} "
                "(~9 h on 2 cores; seed 0 of every point first)",
    runs=_seeds_runs(SEEDS), shared_train=_SEEDS_TRAIN, **_SEEDS_FIELDS,
)
# ---- cpu-noise: seed 0 of two cpu-seeds points again with every initial weight moved by 1e-7 relative
# (TrainConfig.init_perturb, about float32's unit roundoff): how far another CPU's rounding moves a dense and
# a gated run (benchmarks/run_spread.py against the unperturbed run). The gated pair was trained before the
# seeds sweep bounded beta (SEEDS_BETA_MAX), so both members keep the unbounded controller, and the
# unperturbed gated reference lives here (gated-key-mu0.50-s0); the dense reference is cpu-seeds' dense-6-s0.
NOISE_PERTURB = 1e-7


def _noise_runs() -> tuple[RunSpec, ...]:
    out = []
    for r in _CPU_SEEDS.runs:
        if r.name not in ("dense-6-s0", "gated-key-mu0.50-s0"):
            continue
        if r.sparsity.get("controller") == "proportional":
            r = dataclasses.replace(r, sparsity={**r.sparsity, "beta_max": 0.0})
            out.append(r)  # the unperturbed reference
        out.append(dataclasses.replace(r, name=r.name.replace("-s0", "-p1e-7-s0"),
                                       train={**r.train, "init_perturb": NOISE_PERTURB}))
    return tuple(out)


_CPU_NOISE = Grid(
    name="cpu-noise",
    description="issue 14: dense-6 and gated-key-mu0.50 of cpu-seeds (seed 0) with a 1e-7 relative perturbation "
                "of the initial weights, and the gated one's unperturbed reference (~55 min on 2 cores)",
    runs=_noise_runs(), shared_train=_SEEDS_TRAIN, **_SEEDS_FIELDS,
)

GRIDS: dict[str, Grid] = {g.name: g for g in (_CPU, _SMOKE, _PAPER, _PARTS, _PARTS_SMOKE, _CPU_SEEDS, _CPU_NOISE)}


def get_grid(name: str) -> Grid:
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r}; known grids: {', '.join(GRIDS)}")
    return GRIDS[name]


def run_kind(model: dict[str, Any], sparsity: dict[str, Any]) -> str:
    """dense / gated / gated-no-control, from the resolved config dicts."""
    if not model.get("gating", True):
        return KIND_DENSE
    return KIND_NO_CONTROL if sparsity.get("controller") == "none" else KIND_GATED


def train_overrides(grid: Grid, spec: RunSpec, out_dir: Path | str,
                    extra_train: dict[str, Any] | None = None) -> dict[str, Any]:
    """The train-section overrides of one run: its own, then the grid's shared ones, then the caller's
    (e.g. `--data`), then its output folder."""
    return {**spec.train, **grid.shared_train, **(extra_train or {}), "out_dir": str(out_dir)}


def _check_override_names(section: str, overrides: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(SECTION_CLASSES[section])}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"{section} overrides: unknown fields {unknown}")


def resolve_run(grid: Grid, spec: RunSpec, out_dir: Path | str,
                extra_train: dict[str, Any] | None = None) -> tuple[ModelConfig, SparsityConfig, TrainConfig]:
    """The three configs of one run (validated by the dataclasses)."""
    train = train_overrides(grid, spec, out_dir, extra_train)
    for section, over in (("model", spec.model), ("sparsity", spec.sparsity), ("train", train)):
        _check_override_names(section, over)
    return get_preset(spec.preset, model=spec.model, sparsity=spec.sparsity, train=train)


def check_grid(grid: Grid, extra_train: dict[str, Any] | None = None) -> None:
    """Raise ValueError unless every run shares width, vocabulary, data, token budget and seed: the
    comparison in Figure 2 is only meaningful at a fixed width and a fixed number of training tokens."""
    names = [r.name for r in grid.runs]
    if len(set(names)) != len(names):
        raise ValueError(f"grid {grid.name!r}: duplicate run names")
    shared_model = grid.shared_model_fields or ("dim", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim_multiplier",
                                                "norm_placement")
    shared_train = grid.shared_train_fields or ("steps", "batch_size", "seq_len", "seed", "data", "val_data",
                                                "tokenizer_vocab", "eval_tokens")
    ref = None
    for spec in grid.runs:
        m, _, t = resolve_run(grid, spec, Path("unused"), extra_train)
        key = {**{k: getattr(m, k) for k in shared_model}, **{k: getattr(t, k) for k in shared_train}}
        if ref is None:
            ref = (spec.name, key)
        elif key != ref[1]:
            diff = config_mismatch(ref[1], key)
            raise ValueError(f"grid {grid.name!r}: run {spec.name!r} differs from {ref[0]!r}: " + "; ".join(diff))


# ------------------------------------------------------------------------------------------- launchers
def _flag(name: str) -> str:
    # Same field -> flag mapping as midlayer.cli.flag_name (kept local so cli can import this module).
    return "--" + name.replace("_", "-")


def config_flags(model: dict[str, Any], sparsity: dict[str, Any], train: dict[str, Any]) -> list[str]:
    """`midlayer train` flags for the given overrides: `--field-name VALUE`, booleans as --x / --no-x."""
    out: list[str] = []
    for section, over in (("model", model), ("sparsity", sparsity), ("train", train)):
        _check_override_names(section, over)
        for name, value in over.items():
            if isinstance(value, bool):
                out.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
            elif isinstance(value, (tuple, list)):  # the CLI's comma-separated ints (e.g. --ssm-layers 2,3)
                out += [_flag(name), ",".join(str(v) for v in value)]
            else:
                out += [_flag(name), str(value)]
    return out


def _torchrun_executable() -> str:
    # Prefer the torchrun of the running interpreter's environment (a venv not on PATH still works).
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.exists() else (shutil.which("torchrun") or "torchrun")


def torchrun_command(grid: Grid, spec: RunSpec, out_dir: Path | str, nproc: int, resume: bool,
                     extra_train: dict[str, Any] | None = None, torchrun: str | None = None,
                     progress: bool = True) -> list[str]:
    """`torchrun --standalone --nproc_per_node N -m midlayer train <preset> <flags...> [--resume]`
    (plus `--no-progress` when `progress` is False, for logs that are files)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    cmd = [torchrun or _torchrun_executable(), "--standalone", "--nproc_per_node", str(nproc),
           "-m", "midlayer", "train", spec.preset,
           *config_flags(spec.model, spec.sparsity, train_overrides(grid, spec, out_dir, extra_train))]
    if not progress:
        cmd.append("--no-progress")
    if resume:
        cmd.append("--resume")
    return cmd


# ------------------------------------------------------------------------------------------- the sweep
def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, writer=lambda p: p.write_text(json.dumps(data, indent=2) + "\n"))


def diverged(run_dir: Path) -> bool:
    """True when the run's metrics.jsonl records a non-finite loss (the trainer logs it before stopping)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return False
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("event") == "non_finite":
                return True
        except ValueError:
            continue
    return False


def _context_evals(grid: Grid, run_dir: Path, m: ModelConfig, t: TrainConfig, head: str) -> None:
    """The grid's longer-context evaluations of a finished run, unless `extrapolation.json` has them."""
    if not grid.eval_context_multiples:
        return

    longer = {str(t.seq_len * k) for k in grid.eval_context_multiples}
    want = longer | {str(t.seq_len)}
    have = _read_json(run_dir / "extrapolation.json") or {}
    rope = rescalable_rope(m)
    missing = not want <= set(have.get("val_ce") or {}) or (rope and any(
        not longer <= set(have.get(f"val_ce_rope_{s}") or {}) for s in ("linear", "ntk")))
    if not missing:
        return
    if not list_checkpoints(run_dir):  # e.g. a run finished on another machine (checkpoints are not committed)
        print(f"{head}: no checkpoint here to evaluate its longer contexts (RoPE rescaled zero-shot); skipped",
              flush=True)
        return

    got = evaluate_contexts(run_dir, grid.eval_context_multiples)
    print(f"{head}: val_ce by context " + ", ".join(f"{k}: {v:.4f}" for k, v in got["val_ce"].items())
          + "".join(f"; RoPE {s} " + ", ".join(f"{k}: {v:.4f}" for k, v in got[f"val_ce_rope_{s}"].items())
                    for s in ("linear", "ntk") if f"val_ce_rope_{s}" in got), flush=True)


def is_finished(run_dir: Path, steps: int) -> bool:
    """True when `run_dir/eval.json` records a finished run at `steps` steps."""
    res = _read_json(Path(run_dir) / "eval.json")
    return bool(res and res.get("finished") is True and res.get("step") == steps)


def _other_run_here(run_dir: Path, model: ModelConfig, sparsity: SparsityConfig, train_cfg: TrainConfig
                    ) -> list[str]:
    """Differences between the run recorded in `run_dir/config.json` and this one (empty if none/same):
    a finished folder from an edited grid, or from a sweep over other data or another seed, must not be taken
    for this run's result. Train settings that a resume may change (loop.FREE_ON_RESUME, RECOVERY_ON_RESUME:
    logging, checkpoints, a recovery's lr) are not compared."""
    saved = _read_json(run_dir / "config.json")
    if not saved:
        return []
    diffs = []
    free = set(FREE_ON_RESUME) | set(RECOVERY_ON_RESUME)
    for section, cfg in (("model", model), ("sparsity", sparsity), ("train", train_cfg)):
        if isinstance(saved.get(section), dict):
            now = {k: v for k, v in dataclasses.asdict(cfg).items() if section != "train" or k not in free}
            was = {k: v for k, v in saved[section].items() if section != "train" or k not in free}
            diffs += [f"{section}.{d}" for d in config_mismatch(was, now, type(cfg))]
    return diffs


def _check_data(grid: Grid, extra_train: dict[str, Any] | None) -> None:
    data = {**grid.shared_train, **(extra_train or {})}.get("data", "shakespeare")
    if grid.requires_data_glob:
        if data == "shakespeare":
            raise ValueError(f"grid {grid.name!r} trains on FineWeb shards: pass --data GLOB")
        if not globlib.glob(os.path.expanduser(data)):
            raise ValueError(f"grid {grid.name!r}: --data {data!r} matches no files; download FineWeb first "
                             "(midlayer data fineweb --out-dir data/fineweb10B) or pass --data GLOB")


def check_sweep(grid_name: str, out_root: Path, launcher: str = "inline", nproc: int = 1,
                only: list[str] | None = None, extra_train: dict[str, Any] | None = None) -> tuple[Grid, list[Any]]:
    """Every check `run_sweep` makes before it starts a run (grid, launcher, process count, run names, the
    runs' resolved configs, data); returns (grid, the selected runs). Raises ValueError naming the problem."""
    grid = get_grid(grid_name)
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if launcher == "inline" and nproc != 1:
        raise ValueError("--nproc needs --launcher torchrun (the inline launcher is one process)")
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    runs = list(grid.runs)
    if only:
        for name in only:
            grid.run(name)  # raises with the list of known names
        runs = [r for r in runs if r.name in set(only)]
    check_grid(grid, extra_train)
    _check_data(grid, extra_train)
    if launcher == "torchrun":
        # Every rank takes batch_size / nproc sequences in whole micro-batches (train.py); refuse a
        # process count that cannot split the batch before any run starts, not once per run.
        t = resolve_run(grid, runs[0], Path(out_root), extra_train)[2]
        per_rank = t.batch_size // nproc
        if t.batch_size % nproc or per_rank % t.micro_batch_size:
            raise ValueError(f"grid {grid.name!r}: batch_size={t.batch_size} does not split into --nproc {nproc} "
                             f"ranks of whole micro-batches of {t.micro_batch_size} sequences")
    return grid, runs


def run_sweep(grid_name: str, out_root: Path, launcher: str = "inline", nproc: int = 1,
              only: list[str] | None = None, extra_train: dict[str, Any] | None = None, *,
              train_fn: Callable[..., dict[str, Any]] | None = None, progress: bool = True,
              runner: Callable[[list[str]], int] | None = None) -> int:
    """Run grid `grid_name` into `out_root/<grid>/<run>/`; return 0 if every selected run finished, else 1.

    `only` selects runs by name; `extra_train` overrides train fields of every run (e.g. `data`).
    `train_fn` (default `midlayer.train.loop.train`) and `runner` (runs a torchrun command line, returns its exit
    status; default `subprocess.call`) exist so that tests can stand in for real training.
    """
    grid, runs = check_sweep(grid_name, out_root, launcher, nproc, only, extra_train)
    if train_fn is None and launcher == "inline":
        train_fn = train
    runner = runner or (lambda cmd: subprocess.call(cmd))

    sweep_dir = Path(out_root) / grid.name
    # one writer per sweep folder (output_lock.py): two sweeps of one grid would race on sweep.json and runs
    with OutputLock(sweep_dir, "sweep"):
        return _run_sweep(grid, runs, sweep_dir, launcher, nproc, extra_train, train_fn, progress, runner)


def _run_sweep(grid, runs, sweep_dir: Path, launcher: str, nproc: int, extra_train: dict[str, Any] | None,
               train_fn: Callable[..., dict[str, Any]] | None, progress: bool,
               runner: Callable[[list[str]], int]) -> int:
    """The sweep's loop under its output lock: each selected run skipped (finished), resumed or started, inline
    or under torchrun, its record in sweep.json rewritten after every run.

    Long: the per-run bookkeeping (previous records, status, wall time, the launcher's two paths) shares the
    loop's state; the run itself is `train_fn` or `runner`."""
    sweep_json = sweep_dir / "sweep.json"
    old_runs = (_read_json(sweep_json) or {}).get("runs")  # (a hand-edited null or non-list: no records kept)
    previous = {r.get("name"): r for r in (old_runs if isinstance(old_runs, list) else []) if isinstance(r, dict)}
    # One record per run of the whole grid: a sweep of a few runs (`only`) keeps the others' records as they
    # were (status, wall time), so that sweep.json always describes the grid, not the last invocation.
    selected = {spec.name for spec in runs}
    records: list[dict[str, Any]] = []
    for spec in grid.runs:
        if spec.name not in selected and spec.name in previous:
            records.append(previous[spec.name])
            continue
        m, s, t = resolve_run(grid, spec, sweep_dir / spec.name, extra_train)
        records.append({"name": spec.name, "preset": spec.preset, "kind": run_kind(dataclasses.asdict(m),
                                                                                    dataclasses.asdict(s)),
                        "n_layers": m.n_layers, "controller": s.controller if m.gating else None,
                        "mu0": s.mu0 if m.gating else None, "mu_final": s.mu_final if m.gating else None,
                        "steps": t.steps, "tokens": t.steps * t.batch_size * t.seq_len,
                        "out_dir": t.out_dir, "action": None, "status": "pending", "wall_s": None})
    state = {"grid": grid.name, "description": grid.description, "launcher": launcher, "nproc": nproc,
             "extra_train": dict(extra_train or {}), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "runs": records}

    def save_state() -> None:
        _write_json(sweep_json, state)

    save_state()
    n, failed, t_sweep = len(runs), [], time.perf_counter()
    by_name = {rec["name"]: rec for rec in records}
    for i, spec in enumerate(runs, 1):
        rec = by_name[spec.name]
        run_dir = sweep_dir / spec.name
        m, s, t = resolve_run(grid, spec, run_dir, extra_train)
        head = f"[sweep {grid.name} {i}/{n}] {spec.name}"
        try:
            other = _other_run_here(run_dir, m, s, t)
            if other:
                raise ValueError(f"{run_dir} holds a different run ({'; '.join(other)}); move it away")
            old = previous.get(spec.name, {})  # a skipped run keeps the wall time and machine that trained it
            if is_finished(run_dir, t.steps):
                rec.update(action="skip", status="done", wall_s=old.get("wall_s"), machine=old.get("machine"))
                val_ce = (_read_json(run_dir / "eval.json") or {}).get("val_ce")
                print(f"{head}: finished earlier, skipped (val_ce {val_ce})", flush=True)
                _context_evals(grid, run_dir, m, t, head)
                save_state()
                continue
            if grid.divergence_is_a_result and diverged(run_dir):
                rec.update(action="skip", status="diverged", wall_s=old.get("wall_s"), machine=old.get("machine"))
                print(f"{head}: diverged earlier (a result of this grid), skipped", flush=True)
                save_state()
                continue
            ckpts = list_checkpoints(run_dir)
            resume = bool(ckpts)
            # A sweep of several sittings may run on different CPUs, whose rounding moves gated runs
            # (docs/results/noise-cpu.md): record where each run trained.
            rec.update(action="resume" if resume else "start", status="running", machine=cpu_info().summary())
            save_state()
            print(f"{head}: " + (f"resuming from {ckpts[-1].name}" if resume else "starting")
                  + f" ({t.steps} steps x {t.batch_size} x {t.seq_len} tokens)", flush=True)
            t0 = time.perf_counter()
            if launcher == "inline":
                train_fn(m, s, t, resume=resume, progress=progress)
            else:
                cmd = torchrun_command(grid, spec, run_dir, nproc, resume, extra_train, progress=progress)
                print("  " + shlex.join(cmd), flush=True)
                rc = runner(cmd)
                if rc != 0:
                    raise RuntimeError(f"torchrun exited with status {rc}")
            rec["wall_s"] = round(time.perf_counter() - t0, 3)
            if not is_finished(run_dir, t.steps):
                raise RuntimeError(f"training returned but {run_dir / 'eval.json'} does not record a finished "
                                   f"run at step {t.steps}")
            rec["status"] = "done"
            res = _read_json(run_dir / "eval.json") or {}
            print(f"{head}: done in {rec['wall_s']:.1f} s, val_ce {res.get('val_ce')}", flush=True)
            _context_evals(grid, run_dir, m, t, head)
        except Exception as e:  # one bad run must not cost the rest of a long sweep
            if grid.divergence_is_a_result and diverged(run_dir):  # the stability runs: a result
                rec.update(status="diverged", error=f"{type(e).__name__}: {e}")
                print(f"{head}: diverged (recorded as a result): {e}", flush=True)
                save_state()
                continue
            rec.update(status="failed", error=f"{type(e).__name__}: {e}")
            failed.append(spec.name)
            print(f"{head}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if os.environ.get("MIDLAYER_DEBUG"):
                traceback.print_exc()
        save_state()
    state["wall_s"] = round(time.perf_counter() - t_sweep, 3)
    state["failed"] = failed
    save_state()
    print(f"[sweep {grid.name}] {n - len(failed)}/{n} runs done"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; results in {sweep_dir}", flush=True)
    return 1 if failed else 0


__all__ = ["RunSpec", "Grid", "GRIDS", "get_grid", "check_grid", "check_sweep", "resolve_run", "train_overrides",
           "run_kind", "config_flags", "torchrun_command", "is_finished", "diverged", "run_sweep", "PARTS"]

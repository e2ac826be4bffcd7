"""Figure-2 sweep bookkeeping (skip / resume / start / failure), the torchrun command line, grid consistency,
and the tables and plot of midlayer.experiments.plot -- with a stand-in for training, plus one real run of the smoke grid."""

import csv
import dataclasses
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from midlayer import cli
from midlayer.commands import options
from midlayer.config import get_preset
from midlayer.data.shards import write_shard
from midlayer.ops.kernels import cpu_info
from midlayer.experiments.plot import block_check, block_targets, collect, plot_figure2, train_gate_means, write_table
from midlayer.experiments.sweep import (CPU_MU_FINALS, CPU_STEPS, GRIDS, Grid, RunSpec, check_grid, config_flags, get_grid,
                            resolve_run, run_sweep, torchrun_command)
from midlayer.train.loop import train


def _fake_eval(m, s, t, step=None) -> dict:
    """An eval.json as train() writes it, with numbers that depend on the config (so rows are tellable)."""
    step = t.steps if step is None else step
    res = {"step": step, "finished": step == t.steps, "val_ce": 5.0 - 0.1 * m.n_layers + (0.05 if m.gating else 0) + 0.01 * t.seed,
           "val_ppl": 100.0, "gating": m.gating, "n_layers": m.n_layers, "params": 1000 * m.n_layers,
           "flops_per_seq_dense_equiv": 1e6 * m.n_layers, "train_tokens_per_s": 5000.0}
    if m.gating:
        half = m.n_layers // 2
        first = [1.0 - (1.0 - s.mu_final) * i / max(1, half - 1) for i in range(half)]
        res.update(gate_mean=first + first[::-1], gate_sparsity=[1 - g for g in first + first[::-1]])
        res["mean_sparsity"] = float(np.mean(res["gate_sparsity"]))
    else:
        res["mean_sparsity"] = 0.0
    res["flops_per_seq"] = res["flops_per_seq_dense_equiv"] * (1 - res["mean_sparsity"])
    return res


def _write_run(run_dir: Path, m, s, t, step=None, ckpt_step=None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"model": dataclasses.asdict(m), "sparsity": dataclasses.asdict(s),
                                                     "train": dataclasses.asdict(t)}))
    (run_dir / f"ckpt_{(ckpt_step or t.steps):07d}.pt").write_bytes(b"marker")
    (run_dir / "eval.json").write_text(json.dumps(_fake_eval(m, s, t, step)))


class FakeTrain:
    """Stands in for midlayer.train.loop.train: records calls, writes what a finished run leaves behind."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.calls: list[tuple[str, bool]] = []
        self.fail = fail

    def __call__(self, m, s, t, *, resume=False, progress=True):
        name = Path(t.out_dir).name
        self.calls.append((name, resume))
        if name in self.fail:
            raise RuntimeError(f"boom in {name}")
        _write_run(Path(t.out_dir), m, s, t)
        return _fake_eval(m, s, t)


def _cfgs(grid: str, run: str, root: Path):
    g = get_grid(grid)
    return resolve_run(g, g.run(run), root / grid / run)


# --------------------------------------------------------------------------------------------- grids
def test_every_grid_is_consistent():
    for grid in GRIDS.values():
        check_grid(grid)  # same width, vocab, data, steps x batch x seq_len, seed for every run
        budgets = set()
        seeded = "seed" in (grid.shared_train_fields or ("seed",))  # the parts grids vary the seed per run
        for spec in grid.runs:
            m, s, t = resolve_run(grid, spec, Path("x"))
            budgets.add((t.steps * t.batch_size * t.seq_len, t.seed if seeded else None, t.data, m.dim,
                         m.vocab_size))
        assert len(budgets) == 1, (grid.name, budgets)


def test_cpu_grid_is_the_papers_figure2_at_tiny_width():
    grid = get_grid("cpu")
    rows = [resolve_run(grid, spec, Path("x")) for spec in grid.runs]
    dense = sorted(m.n_layers for m, s, t in rows if not m.gating)
    assert dense == [1, 2, 3, 4, 5, 6]
    gated = [(m, s) for m, s, t in rows if m.gating]
    assert all(m.n_layers == 6 for m, s in gated)
    assert [s.controller for m, s in gated].count("none") == 1
    prop = sorted((s.mu_final for m, s in gated if s.controller == "proportional"), reverse=True)
    assert prop == [0.75, 0.5, 0.25, 0.0] == CPU_MU_FINALS
    assert all(s.mu0 == 1.0 for m, s in gated)
    m, s, t = rows[0]
    assert (m.dim, m.n_heads, m.vocab_size, t.seq_len, t.batch_size, t.lr, t.steps) == \
        (128, 4, 4096, 256, 16, 3e-3, CPU_STEPS)
    assert t.eval_tokens == 200_000 and t.data == "shakespeare"


def test_paper_grid_uses_table2_presets_and_fineweb():
    grid = get_grid("paper")
    presets = {spec.name: spec.preset for spec in grid.runs}
    assert all(presets[f"dense-{n}"] == f"paper-dense-{n}" for n in range(2, 13))
    assert {p for n, p in presets.items() if n.startswith("gated")} == {"paper-12l"}
    m, s, t = resolve_run(grid, grid.run("gated-mu0.00"), Path("x"))
    assert (m.n_layers, m.dim, t.steps, t.batch_size, t.seq_len) == (12, 768, 19073, 512, 1024)
    assert t.data == "data/fineweb10B/fineweb_*.bin"
    with pytest.raises(ValueError, match="--data"):  # no shards here: refused before any run starts
        run_sweep("paper", Path("/nonexistent-out"), train_fn=FakeTrain())


def test_check_grid_refuses_a_run_of_another_width():
    bad = Grid("bad", "", (RunSpec("a", "debug"), RunSpec("b", "debug", model={"dim": 64})),
               shared_train={"steps": 3})
    with pytest.raises(ValueError, match="dim"):
        check_grid(bad)
    # A run's own train overrides cannot change the shared budget: the grid's shared values win.
    g = Grid("g", "", (RunSpec("a", "debug", train={"steps": 99}),), shared_train={"steps": 3})
    assert resolve_run(g, g.runs[0], Path("x"))[2].steps == 3


# ------------------------------------------------------------------------------------- bookkeeping
def test_sweep_skips_finished_resumes_partial_starts_new_and_survives_a_failure(tmp_path, capsys):
    root = tmp_path / "out"
    # dense-1: finished earlier.
    m, s, t = _cfgs("smoke", "dense-1", root)
    _write_run(root / "smoke" / "dense-1", m, s, t)
    # dense-2: killed after 3 steps: a checkpoint, no eval.json.
    m, s, t = _cfgs("smoke", "dense-2", root)
    (root / "smoke" / "dense-2").mkdir(parents=True)
    (root / "smoke" / "dense-2" / "ckpt_0000003.pt").write_bytes(b"marker")
    # dense-4: stopped early with stop_after: checkpoint + an unfinished eval.json.
    m, s, t = _cfgs("smoke", "dense-4", root)
    _write_run(root / "smoke" / "dense-4", m, s, t, step=2, ckpt_step=2)

    fake = FakeTrain(fail=("gated-mu0.50",))
    rc = run_sweep("smoke", root, train_fn=fake, progress=False)
    assert rc != 0  # one run failed
    assert fake.calls == [("dense-2", True), ("dense-4", True), ("gated-none", False), ("gated-mu0.50", False),
                          ("gated-mu0.00", False)]  # dense-1 skipped; the run after the failure still ran
    out = capsys.readouterr()
    assert "dense-1: finished earlier, skipped" in out.out
    assert "dense-2: resuming from ckpt_0000003.pt" in out.out
    assert "[sweep smoke 6/6] gated-mu0.00: starting" in out.out
    assert "gated-mu0.50: FAILED: RuntimeError: boom in gated-mu0.50" in out.err

    state = json.loads((root / "smoke" / "sweep.json").read_text())
    by = {r["name"]: r for r in state["runs"]}
    assert [r["name"] for r in state["runs"]] == [s.name for s in get_grid("smoke").runs]
    assert (by["dense-1"]["action"], by["dense-1"]["status"]) == ("skip", "done")
    assert (by["dense-2"]["action"], by["dense-2"]["status"]) == ("resume", "done")
    assert (by["gated-none"]["action"], by["gated-none"]["status"]) == ("start", "done")
    assert by["gated-mu0.50"]["status"] == "failed" and "boom" in by["gated-mu0.50"]["error"]
    assert state["failed"] == ["gated-mu0.50"]
    assert all(isinstance(by[n]["wall_s"], float) for n in ("dense-2", "gated-none"))
    assert by["gated-mu0.00"]["mu_final"] == 0.0 and by["gated-none"]["kind"] == "gated-no-control"

    # Second pass: only the failed run is trained; its earlier attempt left nothing, so it starts afresh.
    fake2 = FakeTrain()
    assert run_sweep("smoke", root, train_fn=fake2, progress=False) == 0
    assert fake2.calls == [("gated-mu0.50", False)]
    state = json.loads((root / "smoke" / "sweep.json").read_text())
    assert {r["status"] for r in state["runs"]} == {"done"} and state["failed"] == []
    # Skipped runs keep the wall time of the pass that trained them.
    assert state["runs"][1]["wall_s"] == by["dense-2"]["wall_s"]
    # ... and the machine it trained on (a sweep of several sittings may change CPU between them).
    assert by["dense-2"]["machine"] == cpu_info().summary() == state["runs"][1]["machine"]
    assert state["runs"][0].get("machine") is None  # finished before any sweep recorded it


def test_sweep_only_selects_runs_and_rejects_unknown_names(tmp_path):
    fake = FakeTrain()
    assert run_sweep("smoke", tmp_path, only=["dense-4", "gated-none"], train_fn=fake, progress=False) == 0
    assert fake.calls == [("dense-4", False), ("gated-none", False)]
    # sweep.json describes the whole grid: a later sweep of other runs keeps these two's records
    grid_names = [r.name for r in get_grid("smoke").runs]
    first = {r["name"]: r for r in json.loads((tmp_path / "smoke" / "sweep.json").read_text())["runs"]}
    assert list(first) == grid_names and first["dense-4"]["status"] == "done"
    assert run_sweep("smoke", tmp_path, only=["dense-1"], train_fn=fake, progress=False) == 0
    state = {r["name"]: r for r in json.loads((tmp_path / "smoke" / "sweep.json").read_text())["runs"]}
    assert list(state) == grid_names
    assert state["dense-4"] == first["dense-4"] and state["gated-none"] == first["gated-none"]
    assert state["dense-1"]["status"] == "done" and state["dense-2"]["status"] == "pending"
    with pytest.raises(ValueError, match="no run 'dense-9'"):
        run_sweep("smoke", tmp_path, only=["dense-9"], train_fn=fake)
    with pytest.raises(ValueError, match="unknown grid"):
        run_sweep("nope", tmp_path, train_fn=fake)
    with pytest.raises(ValueError, match="torchrun"):
        run_sweep("smoke", tmp_path, nproc=2, train_fn=fake)
    with pytest.raises(ValueError, match="does not split"):  # 4 sequences over 3 ranks: refused up front
        run_sweep("smoke", tmp_path, launcher="torchrun", nproc=3, runner=lambda cmd: 0)


def test_extra_train_reaches_every_run(tmp_path):
    fake = FakeTrain()
    seen = []

    def spy(m, s, t, **kw):
        seen.append(t.data)
        return fake(m, s, t, **kw)

    assert run_sweep("smoke", tmp_path, only=["dense-1", "gated-none"], extra_train={"data": "x/*.bin"},
                     train_fn=spy, progress=False) == 0
    assert seen == ["x/*.bin", "x/*.bin"]


def test_a_finished_folder_of_another_run_is_not_taken_as_this_one(tmp_path):
    # The grid was edited (mu_final changed) but the old finished run sits in the folder: refuse, don't skip.
    m, s, t = _cfgs("smoke", "gated-mu0.50", tmp_path)
    s = dataclasses.replace(s, mu_final=0.3)
    _write_run(tmp_path / "smoke" / "gated-mu0.50", m, s, t)
    fake = FakeTrain()
    assert run_sweep("smoke", tmp_path, only=["gated-mu0.50"], train_fn=fake, progress=False) == 1
    assert fake.calls == []
    state = json.loads((tmp_path / "smoke" / "sweep.json").read_text())
    assert "mu_final" in {r["name"]: r for r in state["runs"]}["gated-mu0.50"]["error"]

def test_a_finished_folder_trained_on_other_data_is_not_taken_as_this_one(tmp_path):
    """A sweep continued with other --data (or another seed) does not skip the runs finished on the old one (it
    did: the table then mixed two datasets, and sweep.json named the new one for all); a setting a resume may
    change (logging, checkpoints, a recovery's lr) is not another run."""
    m, s, t = _cfgs("smoke", "dense-2", tmp_path)
    _write_run(tmp_path / "smoke" / "dense-2", m, s, dataclasses.replace(t, data="old/*.bin", seed=t.seed + 1))
    fake = FakeTrain()
    assert run_sweep("smoke", tmp_path, only=["dense-2"], train_fn=fake, progress=False) == 1 and fake.calls == []
    state = json.loads((tmp_path / "smoke" / "sweep.json").read_text())
    error = {r["name"]: r for r in state["runs"]}["dense-2"]["error"]
    assert "train.data" in error and "train.seed" in error
    _write_run(tmp_path / "smoke" / "dense-2", m, s, dataclasses.replace(t, log_every=7, lr=t.lr / 2))
    assert run_sweep("smoke", tmp_path, only=["dense-2"], train_fn=fake, progress=False) == 0 and fake.calls == []


def test_a_run_that_returns_unfinished_counts_as_failed(tmp_path):
    def stops_early(m, s, t, *, resume=False, progress=True):
        _write_run(Path(t.out_dir), m, s, t, step=1, ckpt_step=1)
        return _fake_eval(m, s, t, step=1)

    assert run_sweep("smoke", tmp_path, only=["dense-1"], train_fn=stops_early, progress=False) == 1


# ----------------------------------------------------------------------------------------- torchrun
def test_torchrun_command_line():
    grid = get_grid("cpu")
    spec = grid.run("gated-mu0.25")
    cmd = torchrun_command(grid, spec, "runs/sweep/cpu/gated-mu0.25", 4, resume=False, torchrun="torchrun")
    assert cmd[:9] == ["torchrun", "--standalone", "--nproc_per_node", "4", "-m", "midlayer", "train", "tiny",
                       "--gating"]
    flags = cmd[8:]
    pairs = dict(zip(flags[1::2], flags[2::2]))  # after the lone --gating: --flag value pairs
    assert pairs["--n-layers"] == "6" and pairs["--controller"] == "proportional"
    assert pairs["--mu0"] == "1.0" and pairs["--mu-final"] == "0.25"
    assert pairs["--steps"] == str(CPU_STEPS) and pairs["--out-dir"] == "runs/sweep/cpu/gated-mu0.25"
    assert "--resume" not in cmd
    assert torchrun_command(grid, spec, "o", 4, resume=True, torchrun="torchrun")[-1] == "--resume"
    dense = torchrun_command(grid, grid.run("dense-3"), "o", 1, resume=False, torchrun="torchrun")
    assert "--no-gating" in dense and "--gating" not in dense
    assert torchrun_command(grid, spec, "o", 1, False, progress=False)[-1] == "--no-progress"


def test_torchrun_flags_parse_back_to_the_same_configs():
    # The flag list must mean, to `midlayer train`, exactly the configs the inline launcher would use.
    for grid in GRIDS.values():
        for spec in grid.runs:
            cmd = torchrun_command(grid, spec, "some/dir", 2, resume=True, extra_train={"data": "d/*.bin"})
            args = cli.build_parser().parse_args(cmd[cmd.index("train"):])
            assert args.resume and args.preset == spec.preset
            assert get_preset(args.preset, **options.overrides_from_args(args)) == \
                resolve_run(grid, spec, "some/dir", {"data": "d/*.bin"})


def test_config_flags_rejects_unknown_fields():
    assert config_flags({"gating": False}, {}, {"lr": 0.5}) == ["--no-gating", "--lr", "0.5"]
    with pytest.raises(ValueError, match="unknown fields"):
        config_flags({"width": 3}, {}, {})


def test_sweep_with_torchrun_launcher_runs_one_command_per_run(tmp_path):
    commands = []

    def runner(cmd):  # stands in for subprocess.call: "trains" by writing the finished run's files
        commands.append(cmd)
        name = Path(cmd[cmd.index("--out-dir") + 1]).name
        _write_run(tmp_path / "smoke" / name, *_cfgs("smoke", name, tmp_path))
        return 0 if name != "dense-2" else 3

    (tmp_path / "smoke" / "dense-4").mkdir(parents=True)
    (tmp_path / "smoke" / "dense-4" / "ckpt_0000002.pt").write_bytes(b"marker")
    rc = run_sweep("smoke", tmp_path, launcher="torchrun", nproc=2, only=["dense-1", "dense-2", "dense-4"],
                   runner=runner, progress=False)
    assert rc == 1  # dense-2's torchrun exited with 3
    assert [c[3] for c in commands] == ["2", "2", "2"]
    assert ["--resume" in c for c in commands] == [False, False, True]
    state = {r["name"]: r for r in json.loads((tmp_path / "smoke" / "sweep.json").read_text())["runs"]}
    assert [state[n]["status"] for n in ("dense-1", "dense-2", "dense-4")] == ["done", "failed", "done"]
    assert "status 3" in state["dense-2"]["error"]


# --------------------------------------------------------------------------------------------- plot
def _fake_sweep(root: Path) -> Path:
    """Finished runs of the cpu grid (hand-made eval.json + config.json), no real training."""
    fake = FakeTrain()
    assert run_sweep("cpu", root, only=["dense-1", "dense-2", "dense-6", "gated-none", "gated-mu0.50",
                                        "gated-mu0.00"], train_fn=fake, progress=False) == 0
    return root / "cpu"


def test_collect_leaves_out_folders_the_sweep_does_not_name_and_diverged_runs(tmp_path, capsys):
    """A copy moved aside in the sweep folder (what "move it away" suggests) is not a run of the sweep: counted,
    it was a point of its own and replaced its namesake in the paired depth steps. A run whose final val_ce
    is null (diverged: written as null) is left out with a note; it crashed the whole table. A sweep.json
    whose runs are not a list names none: every folder with an eval.json is read."""
    import shutil

    sweep_dir = _fake_sweep(tmp_path)
    shutil.copytree(sweep_dir / "dense-2", sweep_dir / "dense-2.old")
    res = json.loads((sweep_dir / "dense-6" / "eval.json").read_text())
    (sweep_dir / "dense-6" / "eval.json").write_text(json.dumps({**res, "val_ce": None, "val_ppl": None}))
    rows = collect(sweep_dir)
    err = capsys.readouterr().err
    assert {r["run"] for r in rows} == {"dense-1", "dense-2", "gated-none", "gated-mu0.50", "gated-mu0.00"}
    assert "dense-2.old: not a run of" in err and "dense-6: its final val_ce is None, left out" in err
    state = json.loads((sweep_dir / "sweep.json").read_text())
    (sweep_dir / "sweep.json").write_text(json.dumps({**state, "runs": None}))
    assert "dense-2.old" in {r["run"] for r in collect(sweep_dir)}


def test_collect_and_tables_hold_every_run_with_its_numbers(tmp_path):
    sweep_dir = _fake_sweep(tmp_path)
    rows = collect(sweep_dir)
    by = {r["run"]: r for r in rows}
    assert set(by) == {"dense-1", "dense-2", "dense-6", "gated-none", "gated-mu0.50", "gated-mu0.00"}
    assert by["dense-2"]["kind"] == "dense" and by["dense-2"]["n_layers"] == 2 and by["dense-2"]["mu_final"] is None
    assert by["gated-none"]["kind"] == "gated-no-control" and by["gated-none"]["mu_final"] is None
    assert by["gated-mu0.50"]["kind"] == "gated" and by["gated-mu0.50"]["mu_final"] == 0.5
    assert by["gated-mu0.50"]["n_layers"] == 6 and by["gated-mu0.50"]["mu0"] == 1.0

    write_table(rows, tmp_path / "t.csv", tmp_path / "t.md")
    table = {r["run"]: r for r in csv.DictReader(open(tmp_path / "t.csv"))}
    assert set(table) == set(by)
    for name, r in by.items():
        assert float(table[name]["val_ce"]) == pytest.approx(r["val_ce"])
        assert float(table[name]["flops_per_seq"]) == pytest.approx(r["flops_per_seq"])
        assert float(table[name]["mean_sparsity"]) == pytest.approx(r["mean_sparsity"])
        assert table[name]["kind"] == r["kind"]
    assert table["gated-mu0.00"]["mu_final"] == "0.0" and table["dense-1"]["mu_final"] == ""
    md = (tmp_path / "t.md").read_text()
    for name, r in by.items():
        assert f"| {name} | {r['kind']} | {r['n_layers']} |" in md
        assert f"{r['val_ce']:.4f}" in md
    # The fake gated runs hit their targets exactly (see _fake_eval): every block is met.
    assert "- gated-mu0.50: 3/3 blocks within delta = 0.01 of their target" in md
    assert "| gated-mu0.00 | 1.00 -> 0.00 | 2 | 0.000 | 0.000 | 1.000 | 0.000 | yes |" in md
    assert "| gated-none | no control | 0 | - |" in md


def test_report_carries_each_runs_recorded_wall_time_and_their_sum(tmp_path):
    sweep_dir = _fake_sweep(tmp_path)
    state = json.loads((sweep_dir / "sweep.json").read_text())
    walls = {"dense-1": 360.0, "dense-2": 540.0, "gated-none": 1080.0}  # 6, 9 and 18 min; 0.55 h in all
    for r in state["runs"]:
        r["wall_s"] = walls.get(r["name"])
        r["machine"] = "CPU X; 2 threads" if r["name"] in walls else None
    (sweep_dir / "sweep.json").write_text(json.dumps(state))
    rows = collect(sweep_dir)
    assert {r["run"]: r["wall_s"] for r in rows if r["wall_s"] is not None} == walls
    write_table(rows, tmp_path / "t.csv", tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    assert "| 5,000 | 800 | 9.0 |" in md  # dense-2: tok/s, steps, wall in minutes
    assert "Recorded wall time: 0.6 h over 3 runs (6.0-18.0 min a run" in md
    assert "Machine: CPU X; 2 threads." in md and "`midlayer sweep cpu --out-dir <dir>`" in md
    table = {r["run"]: r for r in csv.DictReader(open(tmp_path / "t.csv"))}
    assert table["gated-none"]["wall_s"] == "1080.0" and table["dense-6"]["wall_s"] == ""


def test_seeds_grid_points_aggregate_by_hand(tmp_path):
    """cpu-seeds: one point per name without its seed; the fake val CE is base + 0.01 * seed, so seeds 0, 1, 2
    give mean base + 0.01 and sample std 0.01; key and query gated points stay apart."""
    from midlayer.experiments.plot import aggregate, point_name
    grid = get_grid("cpu-seeds")
    assert {r.train["seed"] for r in grid.runs} == {0, 1, 2} and len(grid.runs) == 3 * 14
    # the controlled runs train with the setting the controller study chose (SEEDS_*), the others without control
    s = resolve_run(grid, grid.run("gated-query-mu0.00-s2"), tmp_path / "x")[1]
    assert (s.controller, s.mu_final, s.gamma, s.kp, s.reg_grad, s.beta_max) == ("proportional", 0.0, 1e-2, 1.0,
                                                                                 "straight_through_inward", 0.1)
    # cpu-noise keeps the unbounded controller its gated pair was trained with, and holds that pair's reference
    noise = get_grid("cpu-noise")
    assert [r.name for r in noise.runs] == ["dense-6-p1e-7-s0", "gated-key-mu0.50-s0", "gated-key-mu0.50-p1e-7-s0"]
    ref, twin = (resolve_run(noise, noise.run(n), tmp_path / n) for n in ("gated-key-mu0.50-s0", "gated-key-mu0.50-p1e-7-s0"))
    assert ref[1].beta_max == twin[1].beta_max == 0.0 and ref[1].reg_grad == "straight_through_inward"
    assert (ref[2].init_perturb, twin[2].init_perturb) == (0.0, 1e-7)
    assert resolve_run(grid, grid.run("gated-key-none-s0"), tmp_path / "y")[1].controller == "none"
    only = [f"{p}-s{k}" for p in ("dense-2", "gated-key-mu0.50", "gated-query-mu0.50") for k in (0, 1, 2)]
    assert run_sweep("cpu-seeds", tmp_path, only=only, train_fn=FakeTrain(), progress=False) == 0
    rows = collect(tmp_path / "cpu-seeds")
    assert point_name("dense-2-s1") == "dense-2" and point_name("gated-key-none") == "gated-key-none"
    pts = {p["point"]: p for p in aggregate(rows)}
    assert set(pts) == {"dense-2", "gated-key-mu0.50", "gated-query-mu0.50"}
    d = pts["dense-2"]
    assert d["seeds"] == 3 and d["val_ce_mean"] == pytest.approx(4.8 + 0.01)
    assert d["val_ce_std"] == pytest.approx(0.01) and d["val_ce_min"] == pytest.approx(4.8)
    assert d["val_ce_max"] == pytest.approx(4.82) and d["targets_met"] is None
    assert pts["gated-key-mu0.50"]["gate_attention"] == "key" and pts["gated-query-mu0.50"]["gate_attention"] == "query"
    assert pts["gated-key-mu0.50"]["targets_met"] == 3  # the fake runs hit their targets exactly
    write_table(rows, tmp_path / "t.csv", tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    assert "| dense-2 | dense | - | 2 | - | 3 | 4.8100 ± 0.0100 [4.8000-4.8200] |" in md
    # a point with one seed so far (a sweep in progress) shows its value, not a "± 0" spread
    one = [r for r in rows if r["run"] != "dense-2-s1" and r["run"] != "dense-2-s2"]
    write_table(one, tmp_path / "u.csv", tmp_path / "u.md")
    assert "| dense-2 | dense | - | 2 | - | 1 | 4.8000 | 0.000 |" in (tmp_path / "u.md").read_text()
    pcsv = {r["point"]: r for r in csv.DictReader(open(tmp_path / "t-points.csv"))}
    assert float(pcsv["gated-query-mu0.50"]["val_ce_mean"]) == pytest.approx(4.45 + 0.01)
    if importlib.util.find_spec("matplotlib") is not None:
        plot_figure2(rows, tmp_path / "f.png")
        assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_block_targets_and_check_by_hand():
    assert block_targets(1.0, 0.5, 6) == pytest.approx([1.0, 0.75, 0.5])
    assert block_targets(1.0, 0.0, 12) == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    row = {"run": "g", "kind": "gated", "n_layers": 6, "mu0": 1.0, "mu_final": 0.5, "delta": 0.01,
           # block 0: |0.995 - 1| = 0.005 met; block 1: |0.70 - 0.75| = 0.05 not; block 2: |0.51 - 0.5| = 0.01,
           # exactly the dead band: met. The mirror half (blocks 3..5) is ignored.
           "gate_mean": [0.995, 0.70, 0.51, 0.0, 0.0, 0.0], "gate_sparsity": [0.0, 0.2, 0.45, 0, 0, 0]}
    checks = block_check(row)
    assert [c["target"] for c in checks] == pytest.approx([1.0, 0.75, 0.5])
    assert [c["diff"] for c in checks] == pytest.approx([0.005, 0.05, 0.01])
    assert [c["met"] for c in checks] == [True, False, True]
    assert [c["sparsity"] for c in checks] == [0.0, 0.2, 0.45]
    assert [c["met"] for c in block_check({**row, "delta": 0.1})] == [True, True, True]
    free = block_check({**row, "kind": "gated-no-control", "mu0": None, "mu_final": None})
    assert [c["met"] for c in free] == [None, None, None] and free[1]["gate_mean"] == 0.70


def test_train_gate_means_by_hand(tmp_path):
    """The last 100 steps' logged training gates, per block: steps 1110 and 1200 of a 1200-step run count, 1100
    (and 1000) do not; a step logged twice (a resumed run) counts once with its last record; a cut line is skipped."""
    recs = [{"step": 1000, "gate_mean/0": 0.0, "gate_mean/1": 0.0},
            {"step": 1100, "gate_mean/0": 0.0, "gate_mean/1": 0.0},
            {"step": 1110, "gate_mean/0": 0.9, "gate_mean/1": 0.1},
            {"step": 1200, "gate_mean/0": 0.5, "gate_mean/1": 0.5},  # overwritten by the resumed run's record
            {"step": 1200, "gate_mean/0": 1.0, "gate_mean/1": 0.6},
            {"event": "final", "val_ce": 4.0, "gate_mean": [0.2, 0.3]}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + '\n{"step": 12')
    assert train_gate_means(tmp_path) == pytest.approx([0.95, 0.35])
    assert train_gate_means(tmp_path, window=200) == pytest.approx([(0.0 + 0.9 + 1.0) / 3, (0.0 + 0.1 + 0.6) / 3])
    assert train_gate_means(tmp_path, window=201) == pytest.approx([1.9 / 4, 0.7 / 4])
    assert train_gate_means(tmp_path / "missing") is None
    row = {"run": "g", "kind": "gated", "n_layers": 4, "mu0": 1.0, "mu_final": 0.5, "delta": 0.01,
           "gate_mean": [0.995, 0.45, 0.45, 0.995], "gate_sparsity": [0.0, 0.5, 0.5, 0.0],
           "train_gate_mean": train_gate_means(tmp_path)}
    checks = block_check(row)  # targets 1.0, 0.5: train 0.95 (0.05 off), 0.35 (0.15 off); val 0.005, 0.05 off
    assert [c["met"] for c in checks] == [True, False]
    assert [c["train_diff"] for c in checks] == pytest.approx([0.05, 0.15])
    assert [c["train_met"] for c in checks] == [False, False]
    assert [c["train_met"] for c in block_check({**row, "delta": 0.16})] == [True, True]
    assert block_check({**row, "train_gate_mean": None})[0]["train_met"] is None


def test_report_judges_controlled_points_on_training_batches_over_seeds(tmp_path):
    """Three seeds of one controlled point with logged training gates: the per-point block table gives the
    mean ± std over seeds on both sides and counts the seeds within delta."""
    only = [f"gated-key-mu0.50-s{k}" for k in (0, 1, 2)]
    assert run_sweep("cpu-seeds", tmp_path, only=only, train_fn=FakeTrain(), progress=False) == 0
    # training gates of block 1 (target 0.75): 0.75, 0.76, 0.80 -> mean 0.77, std 0.02646; 2 of 3 within 0.01
    for k, g1 in enumerate((0.75, 0.76, 0.80)):
        (tmp_path / "cpu-seeds" / only[k] / "metrics.jsonl").write_text(json.dumps(
            {"step": 1200, "gate_mean/0": 1.0, "gate_mean/1": g1, "gate_mean/2": 0.5}) + "\n")
    rows = collect(tmp_path / "cpu-seeds")
    assert [r["train_gate_mean"][1] for r in rows] == pytest.approx([0.75, 0.76, 0.80])
    write_table(rows, tmp_path / "t.csv", tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    # the fake evaluation hits every target exactly (_fake_eval): 3/3 on validation
    assert "| gated-key-mu0.50 | 1 | 0.750 | 0.750 ± 0.000 | 3/3 | 0.770 ± 0.026 | 2/3 |" in md
    assert "| gated-key-mu0.50 | 0 | 1.000 | 1.000 ± 0.000 | 3/3 | 1.000 ± 0.000 | 3/3 |" in md
    assert "- gated-key-mu0.50-s2: 3/3 blocks within delta = 0.01 of their target, 2/3 on training batches" in md
    # a seed without a training log is left out of that side's mean and count, not counted as a miss
    (tmp_path / "cpu-seeds" / only[2] / "metrics.jsonl").unlink()
    write_table(collect(tmp_path / "cpu-seeds"), tmp_path / "u.csv", tmp_path / "u.md")
    assert "| gated-key-mu0.50 | 1 | 0.750 | 0.750 ± 0.000 | 3/3 | 0.755 ± 0.007 | 2/2 |" in (tmp_path / "u.md").read_text()
    with pytest.raises(ValueError, match="window"):
        train_gate_means(tmp_path, window=0)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = collect(_fake_sweep(tmp_path))
    plot_figure2(rows, tmp_path / "fig" / "f.png")
    data = (tmp_path / "fig" / "f.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_plot_writes_prefix_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    sweep_dir = _fake_sweep(tmp_path)
    assert cli.main(["plot", str(sweep_dir), "--out", str(tmp_path / "res" / "fig2")]) == 0
    for ext in ("png", "csv", "md"):
        assert (tmp_path / "res" / f"fig2.{ext}").exists()
    assert "![" in (tmp_path / "res" / "fig2.md").read_text()
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2


# ----------------------------------------------------------------------------- real smoke grid, ~5 s
def _shards(tmp: Path, vocab: int = 512, n: int = 20_000) -> str:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, vocab, n)
    d = tmp / "shards"
    d.mkdir()
    write_shard(d / "syn_train_000.bin", toks[: n * 3 // 4])
    write_shard(d / "syn_val_000.bin", toks[n * 3 // 4:])
    return str(d / "*.bin")


def test_smoke_grid_really_trains_then_skips(tmp_path, capsys):
    data = _shards(tmp_path)
    out = tmp_path / "sweep"
    assert cli.main(["sweep", "smoke", "--out-dir", str(out), "--data", data]) == 0
    names = [s.name for s in get_grid("smoke").runs]
    for name in names:
        res = json.loads((out / "smoke" / name / "eval.json").read_text())
        assert res["finished"] and res["step"] == get_grid("smoke").shared_train["steps"]
    capsys.readouterr()
    assert cli.main(["sweep", "smoke", "--out-dir", str(out), "--data", data]) == 0
    assert capsys.readouterr().out.count("finished earlier, skipped") == len(names)
    rows = collect(out / "smoke")
    assert sorted(r["run"] for r in rows) == sorted(names)


def test_smoke_run_killed_midway_is_resumed_by_the_next_sweep(tmp_path):
    data = _shards(tmp_path)
    # First pass "dies" after 2 of 4 steps (stop_after leaves a checkpoint and an unfinished eval.json) ...
    killed = functools.partial(train, stop_after=2)
    assert run_sweep("smoke", tmp_path, only=["gated-mu0.50"], extra_train={"data": data}, train_fn=killed,
                     progress=False) == 1
    run_dir = tmp_path / "smoke" / "gated-mu0.50"
    assert [p.name for p in run_dir.glob("ckpt_*.pt")] == ["ckpt_0000002.pt"]
    # ... the next pass resumes it to the end.
    assert run_sweep("smoke", tmp_path, only=["gated-mu0.50"], extra_train={"data": data}, progress=False) == 0
    state = json.loads((tmp_path / "smoke" / "sweep.json").read_text())
    assert {r["name"]: r for r in state["runs"]}["gated-mu0.50"]["action"] == "resume"
    assert json.loads((run_dir / "eval.json").read_text())["step"] == 4


def test_parts_grid_changes_one_part_at_a_time_with_two_seeds():
    from midlayer.config import ModelConfig
    from midlayer.model.flops import param_count
    from midlayer.experiments.sweep import PARTS

    grid = get_grid("parts")
    base, _, tb = resolve_run(grid, grid.run("baseline-s0"), Path("x"))
    assert not base.gating and base.max_seq_len == 4 * tb.seq_len  # room for the 4x-context evaluation
    defaults = ModelConfig()
    for name, over in PARTS:
        for seed in (0, 1):
            m, _, t = resolve_run(grid, grid.run(f"{name}-s{seed}"), Path("x"))
            assert t.seed == seed and t.steps == tb.steps and t.lr == tb.lr
            changed = {k for k in vars(m) if getattr(m, k) != getattr(base, k)}
            assert changed == set(over) - {k for k, v in over.items() if getattr(base, k) == v}, name
        if name.endswith("-mlp"):  # the plain MLPs get the GLU's parameter count back
            assert abs(param_count(m) - param_count(base)) < 0.01 * param_count(base)
    assert defaults.norm_placement == base.norm_placement == "sandwich"
    lrs = {spec.name: resolve_run(grid, spec, Path("x"))[2].lr for spec in grid.runs if "-lr" in spec.name}
    assert lrs == {f"{p}-lr{k}x-s0": pytest.approx(3e-3 * k) for p in ("sandwich", "pre", "post") for k in (3, 10)}


def test_parts_smoke_sweep_evaluates_longer_contexts_records_divergence_and_reports(tmp_path, monkeypatch):
    """The parts machinery for real at the debug width: every run finishes with CE at 1x/2x/4x its context;
    a run whose loss goes non-finite is recorded as diverged (a result, not a failure) and skipped next
    time; `midlayer plot` writes the parts table and bar chart."""
    import dataclasses as dc

    import midlayer.experiments.sweep as sw
    from midlayer.experiments.plot import collect_parts

    data = _shards(tmp_path)
    grid = sw.get_grid("parts-smoke")
    blowup = dc.replace(grid.runs[-1], name="post-lr1000000x-s0", train={"seed": 0, "lr": 1e3})
    monkeypatch.setitem(sw.GRIDS, "parts-smoke", dc.replace(grid, runs=grid.runs + (blowup,)))
    out = tmp_path / "sweep"
    assert cli.main(["sweep", "parts-smoke", "--out-dir", str(out), "--data", data]) == 0
    state = json.loads((out / "parts-smoke" / "sweep.json").read_text())
    status = {r["name"]: r["status"] for r in state["runs"]}
    assert status.pop("post-lr1000000x-s0") == "diverged" and set(status.values()) == {"done"}
    for name in status:
        if "-lr" not in name:
            ext = json.loads((out / "parts-smoke" / name / "extrapolation.json").read_text())
            assert sorted(ext["val_ce"], key=int) == ["32", "64", "128"]
            # plain-RoPE runs are also evaluated with their RoPE rescaled zero-shot (PI and NTK, by the multiple)
            rope = not name.startswith("alibi")
            for scaling in ("linear", "ntk"):
                assert (sorted(ext.get(f"val_ce_rope_{scaling}", {}), key=int) == ["64", "128"]) is rope, name
    # the rescaled number is the CE of the same weights in a model built with that scaling
    from midlayer.data.shards import TokenWindows
    from midlayer.train.evaluate import evaluate, load_run
    from midlayer.model.transformer import Transformer

    run = out / "parts-smoke" / "baseline-s0"
    model, mcfg, tcfg, files, _ = load_run(run)
    twin = Transformer(dataclasses.replace(mcfg, rope_scaling="linear", rope_scale=4.0))
    twin.load_state_dict(model.state_dict())
    want = evaluate(twin.eval(), TokenWindows(files.val, 128), eval_tokens=tcfg.eval_tokens,
                    batch_size=max(1, tcfg.micro_batch_size * tcfg.seq_len // 128), device=torch.device("cpu"),
                    dtype=torch.float32)["val_ce"]
    ext = json.loads((run / "extrapolation.json").read_text())
    assert ext["val_ce_rope_linear"]["128"] == pytest.approx(want, rel=1e-6)
    assert ext["val_ce_rope_linear"]["128"] != ext["val_ce"]["128"]
    assert cli.main(["sweep", "parts-smoke", "--out-dir", str(out), "--data", data]) == 0  # all skipped
    rows, stability = collect_parts(out / "parts-smoke")
    assert sorted(r["part"] for r in rows) == ["alibi", "baseline", "relu-mlp"]
    assert all(r["seeds"] == 2 and r["val_ce_x4"] is not None for r in rows)
    assert next(r for r in rows if r["part"] == "baseline")["delta"] == 0.0
    assert {(r["placement"], r["lr_multiple"], r["diverged"]) for r in stability} >= {("post", 1000000, True)}
    # lr x 1 of each stability curve is its placement's seed-0 run of the grid: sandwich's is baseline-s0; pre-
    # and post-LN have no part in the smoke grid, so no 1x point is made up for them
    base_ce = json.loads((out / "parts-smoke" / "baseline-s0" / "eval.json").read_text())["val_ce"]
    assert [r for r in stability if r["lr_multiple"] == 1] == [
        {"placement": "sandwich", "lr_multiple": 1, "val_ce": base_ce, "diverged": False}]
    assert {r["speed_source"] for r in rows} == {"runs"}  # no throughput.json yet: the runs' own speeds
    # benchmarks/parts_throughput.py times every part of the grid (seed 0's config) and writes throughput.json
    # into the sweep folder; the report then takes its speeds instead of the runs' own.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import parts_throughput

    bench_json = out / "parts-smoke" / "throughput.json"
    assert parts_throughput.main(["--grid", "parts-smoke", "--repeats", "1", "--warmup", "0",
                                  "--out", str(bench_json)]) == 0
    timed = json.loads(bench_json.read_text())["parts"]
    assert list(timed) == ["baseline", "alibi", "relu-mlp"] and timed["baseline"]["speed_vs_baseline"] == 1.0
    rows, _ = collect_parts(out / "parts-smoke")
    for r in rows:
        assert r["speed_source"] == "benchmark" and r["tokens_per_s"] == timed[r["part"]]["tokens_per_s"]
    prefix = tmp_path / "report" / "parts"
    has_mpl = importlib.util.find_spec("matplotlib") is not None  # an optional extra: the tables come first
    assert cli.main(["plot", str(out / "parts-smoke"), "--out", str(prefix)]) == (0 if has_mpl else 2)
    md = (tmp_path / "report" / "parts.md").read_text()
    assert "| alibi | 2 |" in md and "diverged" in md
    assert (tmp_path / "report" / "parts.png").is_file() == has_mpl


def test_equal_flops_gap_pairs_seeds_by_hand(tmp_path):
    """gated - dense at equal FLOPs, per seed, by hand: the dense curve is linear between the bracketing depths."""
    from midlayer.experiments.plot import dense_at, equal_flops_gaps
    assert dense_at(150.0, [(200.0, 4.0), (100.0, 5.0)]) == pytest.approx(4.5)
    assert dense_at(125.0, [(100.0, 5.1), (200.0, 4.2), (300.0, 4.0)]) == pytest.approx(4.875)
    assert dense_at(250.0, [(100.0, 5.1), (200.0, 4.2), (300.0, 4.0)]) == pytest.approx(4.1)
    assert dense_at(99.0, [(100.0, 5.1), (200.0, 4.2)]) is None and dense_at(150.0, []) is None
    # both ends of the dense range are in it: a gated run at exactly the cheapest or the deepest depth's FLOPs
    assert dense_at(100.0, [(100.0, 5.0), (200.0, 4.0)]) == 5.0 and dense_at(200.0, [(100.0, 5.0), (200.0, 4.0)]) == 4.0

    def run(name, kind, seed, flops, ce):
        return {"run": name, "kind": kind, "n_layers": 6, "seed": seed, "flops_per_seq": flops, "val_ce": ce,
                "mu_final": 0.5 if kind == "gated" else None, "gate_attention": None if kind == "dense" else "key"}
    rows = [run("dense-1-s0", "dense", 0, 100.0, 5.0), run("dense-2-s0", "dense", 0, 200.0, 4.0),
            run("dense-1-s1", "dense", 1, 100.0, 5.1), run("dense-2-s1", "dense", 1, 200.0, 4.2),
            # seed 0: 4.4 against 4.5 -> -0.1; seed 1: 4.9 against 4.875 -> +0.025
            run("g-s0", "gated", 0, 150.0, 4.4), run("g-s1", "gated", 1, 125.0, 4.9),
            # seed 0 lower by 0.2 and 0.3 (4.3, 4.575 against 4.5, 4.875); seed 2 has no dense curve: left out
            run("h-s0", "gated-no-control", 0, 150.0, 4.3), run("h-s1", "gated-no-control", 1, 125.0, 4.575),
            run("h-s2", "gated-no-control", 2, 125.0, 1.0),
            run("far-s0", "gated", 0, 250.0, 4.0)]  # beyond the dense range: no gap
    gaps = {g["point"]: g for g in equal_flops_gaps(rows)}
    assert set(gaps) == {"g", "h"}
    g = gaps["g"]
    assert g["gaps"] == pytest.approx([-0.1, 0.025]) and g["gap_mean"] == pytest.approx(-0.0375)
    assert g["gap_std"] == pytest.approx(0.125 / math.sqrt(2))
    assert g["gap_ci95"] == pytest.approx(12.706 * 0.125 / math.sqrt(2) / math.sqrt(2))
    assert g["dense_ce_mean"] == pytest.approx((4.5 + 4.875) / 2) and g["flops_per_seq_mean"] == pytest.approx(137.5)
    assert (g["gated_lower"], g["seeds"], g["verdict"]) == (1, 2, "within noise")
    h = gaps["h"]
    assert h["gaps"] == pytest.approx([-0.2, -0.3]) and h["gated_lower"] == 2
    # mean -0.25, std 0.0707, half-width 12.706 * 0.05 = 0.635: two seeds cannot exclude 0 here
    assert h["verdict"] == "within noise" and h["gap_ci95"] == pytest.approx(12.706 * 0.05)
    tight = equal_flops_gaps([*rows[:4], run("dense-1-s2", "dense", 2, 100.0, 5.0), run("dense-2-s2", "dense", 2, 200.0, 4.0),
                              run("h-s0", "gated-no-control", 0, 150.0, 4.3),
                              run("h-s1", "gated-no-control", 1, 125.0, 4.675),
                              run("h-s2", "gated-no-control", 2, 150.0, 4.25)])
    # gaps -0.2, -0.2, -0.25: mean -0.21667, std 0.028868, half-width 4.303 * 0.028868 / sqrt(3) = 0.0717
    assert tight[0]["gap_ci95"] == pytest.approx(4.303 * 0.028868 / math.sqrt(3), rel=1e-4)
    assert tight[0]["verdict"] == "gated lower"
    # a gap of exactly 0 (seed 1 at the cheapest depth, equal CE) is not "gated lower"; seed 0 at the deepest is
    tie = equal_flops_gaps([*rows[:4], run("t-s0", "gated", 0, 200.0, 3.9), run("t-s1", "gated", 1, 100.0, 5.1)])
    assert tie[0]["gaps"] == pytest.approx([-0.1, 0.0]) and tie[0]["gated_lower"] == 1
    write_table(rows, tmp_path / "t.csv", tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    assert "| g | 2 | 0.0 | 4.6500 | 4.6875 | -0.0375 ± 0.0884 | [-0.8316, +0.7566] | 1/2 | within noise |" in md


def test_depth_steps_by_hand(tmp_path):
    """Consecutive dense depths, paired by seed: 2 -> 3 layers lowers CE by 0.10, 0.12, 0.11 (mean -0.11, std
    0.01, half-width 4.303 * 0.01 / sqrt(3)): 'deeper lower'; 3 -> 4 by -0.01, +0.02, 0.0: within noise."""
    from midlayer.experiments.plot import depth_steps, paired_difference
    ce = {2: (4.50, 4.52, 4.51), 3: (4.40, 4.40, 4.40), 4: (4.39, 4.42, 4.40)}
    rows = [{"run": f"dense-{n}-s{k}", "kind": "dense", "n_layers": n, "seed": k, "val_ce": ce[n][k],
             "flops_per_seq": 100.0 * n} for n in ce for k in range(3)]
    steps = depth_steps(rows)
    assert [(d["from"], d["to"], d["seeds"]) for d in steps] == [(2, 3, 3), (3, 4, 3)]
    assert steps[0]["diffs"] == pytest.approx([-0.10, -0.12, -0.11]) and steps[0]["std"] == pytest.approx(0.01)
    assert steps[0]["ci95"] == pytest.approx(4.303 * 0.01 / math.sqrt(3)) and steps[0]["verdict"] == "deeper lower"
    assert steps[1]["mean"] == pytest.approx(0.01 / 3) and steps[1]["verdict"] == "within noise"
    assert paired_difference([0.5])["verdict"] == "one seed" and paired_difference([0.5])["ci95"] is None
    assert paired_difference([1.0, 1.1, 0.9], ("a", "b"))["verdict"] == "b"
    write_table(rows, tmp_path / "t.csv", tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    assert "| 2 -> 3 | 3 | -0.1100 ± 0.0100 | [-0.1348, -0.0852] | deeper lower |" in md
    assert md.index("## Do the dense depths separate?") < md.index("## Runs")


def test_key_vs_query_gating_pairs_equal_flops_gaps_by_seed(tmp_path):
    """Key- minus query-indexed gating at one controller setting, per seed, through each one's gap to the same
    seed's dense curve: key gaps +0.05, +0.03 (seeds 0, 1) and query gaps -0.05, -0.02 give +0.10, +0.05; the
    query point's seed 2 has no key partner and is left out; a key point without a query partner gets no row."""
    from midlayer.experiments.plot import equal_flops_gaps, gating_differences

    def run(name, kind, seed, flops, ce, att=None, mu=None):
        return {"run": name, "kind": kind, "n_layers": 6, "seed": seed, "flops_per_seq": flops, "val_ce": ce,
                "mu_final": mu, "gate_attention": att}
    # dense curve per seed: 5.0 at 100 FLOPs, 4.0 at 200, so 4.5 at 150 and 4.8 at 120
    rows = [run(f"dense-{n}-s{k}", "dense", k, 100.0 * n, 6.0 - n) for n in (1, 2) for k in range(3)]
    rows += [run("gated-key-mu0.50-s0", "gated", 0, 150.0, 4.55, "key", 0.5),
             run("gated-key-mu0.50-s1", "gated", 1, 120.0, 4.83, "key", 0.5),
             run("gated-query-mu0.50-s0", "gated", 0, 120.0, 4.75, "query", 0.5),
             run("gated-query-mu0.50-s1", "gated", 1, 150.0, 4.48, "query", 0.5),
             run("gated-query-mu0.50-s2", "gated", 2, 150.0, 4.0, "query", 0.5),
             run("gated-key-mu0.25-s0", "gated", 0, 150.0, 4.5, "key", 0.25)]
    pairs = gating_differences(equal_flops_gaps(rows))
    assert [(d["key"], d["query"], d["seeds"]) for d in pairs] == [("gated-key-mu0.50", "gated-query-mu0.50", 2)]
    d = pairs[0]
    assert d["diffs"] == pytest.approx([0.10, 0.05]) and d["mean"] == pytest.approx(0.075)
    assert d["std"] == pytest.approx(0.05 / math.sqrt(2)) and d["verdict"] == "within noise"
    write_table(rows, tmp_path / "t.csv", tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    assert "| gated-key-mu0.50 | gated-query-mu0.50 | 2 | +0.0750 ± 0.0354 |" in md
    assert md.index("## Key- vs query-indexed gating") < md.index("## Runs")


def test_pooled_gaps_average_each_seeds_points_first_by_hand(tmp_path):
    """Per gating index: per seed, the mean gap over its points, then a t interval over the seeds. Key points
    a (gaps +0.05, +0.03, +0.04) and b (+0.01, +0.03, +0.02) give seed means +0.03, +0.03, +0.03 (std 0:
    'dense lower'); the query point has seeds 0-1 only, gaps -0.05 and +0.05: mean 0, 'within noise'."""
    from midlayer.experiments.plot import pooled_gaps

    def gap(point, att, by_seed):
        return {"point": point, "gate_attention": att, "gap_by_seed": dict(enumerate(by_seed))}
    gaps = [gap("a", "key", [0.05, 0.03, 0.04]), gap("b", "key", [0.01, 0.03, 0.02]),
            gap("q", "query", [-0.05, 0.05]), gap("none-index", None, [9.0])]
    pooled = {p["gate_attention"]: p for p in pooled_gaps(gaps)}
    assert set(pooled) == {"key", "query"}
    k, q = pooled["key"], pooled["query"]
    assert (k["points"], k["seeds"]) == (2, 3) and k["seed_means"] == pytest.approx([0.03, 0.03, 0.03])
    assert k["mean"] == pytest.approx(0.03) and k["std"] == pytest.approx(0.0, abs=1e-12)
    assert k["verdict"] == "dense lower"
    assert q["seed_means"] == pytest.approx([-0.05, 0.05]) and q["std"] == pytest.approx(0.1 / math.sqrt(2))
    assert q["ci95"] == pytest.approx(12.706 * 0.05) and q["verdict"] == "within noise"
    # a point missing a seed restricts its index to the seeds every point has
    assert pooled_gaps([gap("a", "key", [0.1, 0.2]), gap("b", "key", [0.3])])[0]["seed_means"] == pytest.approx([0.2])


def test_collect_prices_runs_with_the_current_cost_model(tmp_path):
    """A run evaluated before a correction of the cost model (here: a query-gated run, whose skipped tokens
    still need their keys and values) is priced again from its config and measured sparsity; where the config
    cannot be rebuilt the stored numbers stay."""
    from midlayer.config import ModelConfig, SparsityConfig, TrainConfig
    from midlayer.model.flops import active_param_count, forward_flops, param_count
    sweep = tmp_path / "grid"
    z = [0.0, 0.25, 0.5]
    for mode in ("key", "query"):
        m = ModelConfig(dim=32, n_layers=6, n_heads=2, n_kv_heads=2, vocab_size=64, max_seq_len=16, gating=True,
                        gate_attention=mode)
        _write_run(sweep / f"gated-{mode}", m, SparsityConfig(), TrainConfig(steps=4))
        res = json.loads((sweep / f"gated-{mode}" / "eval.json").read_text())
        res.update(seq_len=16, gate_sparsity=z + z[::-1], flops_per_seq=1.0, flops_per_seq_dense_equiv=2.0,
                   params=param_count(m))
        (sweep / f"gated-{mode}" / "eval.json").write_text(json.dumps(res))
    stale = {"val_ce": 4.0, "flops_per_seq": 3.0, "flops_per_seq_dense_equiv": 4.0, "active_params": 5.0,
             "seq_len": 16, "gating": True, "n_layers": 6, "gate_sparsity": z + z[::-1]}
    # a config from another version, none at all, and one that is not the evaluated model: stored numbers stay
    for name, model in (("old", {"n_layers": 6, "gating": True, "retired": 1}), ("bare", None),
                        ("other", dataclasses.asdict(ModelConfig(dim=64, n_layers=6, n_heads=4, n_kv_heads=4, gating=True)))):
        (sweep / name).mkdir()
        if model is not None:
            (sweep / name / "config.json").write_text(json.dumps({"model": model}))
        (sweep / name / "eval.json").write_text(json.dumps({**stale, "params": 1234}))
    by = {r["run"]: r for r in collect(sweep)}
    for mode in ("key", "query"):
        m = ModelConfig(dim=32, n_layers=6, n_heads=2, n_kv_heads=2, vocab_size=64, max_seq_len=16, gating=True,
                        gate_attention=mode)
        assert by[f"gated-{mode}"]["flops_per_seq"] == forward_flops(m, 16, z).total
        assert by[f"gated-{mode}"]["flops_per_seq_dense_equiv"] == forward_flops(m, 16).total
        assert by[f"gated-{mode}"]["active_params"] == active_param_count(m, z)
    assert by["gated-query"]["flops_per_seq"] > by["gated-key"]["flops_per_seq"]
    # query gating still uses each skipped block's input norm, wk and wv: per block 32 + 2 * 32 * 32 = 2080
    assert by["gated-query"]["active_params"] - by["gated-key"]["active_params"] == pytest.approx(2 * 0.75 * 2080)
    for name in ("old", "bare", "other"):
        assert (by[name]["flops_per_seq"], by[name]["flops_ratio"], by[name]["active_params"]) == (3.0, 0.75, 5.0)


def test_t_quantile_beyond_the_table_and_a_twelve_seed_interval():
    """Beyond 10 degrees of freedom the interval used the normal quantile 1.96: with 12 seeds a 92% interval
    called "higher" what a 95% one does not. t975 continues the table (exact values: standard tables)."""
    from midlayer.experiments.plot import paired_difference, t975

    for df, exact in ((10, 2.228), (11, 2.201), (12, 2.179), (20, 2.086), (30, 2.042), (120, 1.980)):
        assert t975(df) == pytest.approx(exact, abs=6e-4), df
    xs = [0.01 * x for x in (-1.5, -1.2, -0.9, -0.6, -0.3, 0.0, 0.0, 0.3, 0.6, 0.9, 1.2, 1.5)]
    std = math.sqrt(sum(x * x for x in xs) / 11)
    diffs = [x + 2.08 * std / math.sqrt(12) for x in xs]  # t = 2.08: between 1.96 and t975(11) = 2.201
    d = paired_difference(diffs)
    assert d["ci95"] == pytest.approx(t975(11) * std / math.sqrt(12))
    assert d["mean"] - d["ci95"] < 0 < d["mean"] - 1.96 * std / math.sqrt(12)  # 1.96 excluded 0 here
    assert d["verdict"] == "within noise"


def test_plot_without_configs_pairs_by_the_names_seeds_and_refuses_foreign_folders(tmp_path, capsys):
    """Runs whose config.json is gone: the seed comes from the run's name (every seed was None, and the paired
    comparisons pooled all seeds' dense runs into one curve) and the gating index is unknown (it was taken for
    "key"). sweep.json that is no sweep's record, a parts run with a string val_ce, and runs of no Figure-2 grid
    without a sweep.json are one-line errors or notes, not tracebacks or a report of the wrong kind. The default
    output is in the sweep's folder (docs/results' hand-written pages were replaced)."""
    import shutil

    from midlayer.experiments.plot import collect_parts, run_seed, write_report

    assert run_seed("gated-key-mu0.25-s2", {}) == 2 and run_seed("x-s1", {"train": {"seed": 7}}) == 7
    assert run_seed("dense-3", {}) is None
    sweep_dir = _fake_sweep(tmp_path)
    for run in sweep_dir.iterdir():
        if run.is_dir():
            shutil.copytree(run, sweep_dir / f"{run.name}-s1")
            for p in (run, sweep_dir / f"{run.name}-s1"):
                (p / "config.json").unlink()
            run.rename(sweep_dir / f"{run.name}-s0")
    (sweep_dir / "sweep.json").unlink()
    rows = collect(sweep_dir)
    assert sorted({r["seed"] for r in rows}) == [0, 1]
    assert all(r["gate_attention"] is None for r in rows if r["kind"] != "dense")
    try:
        write_report(sweep_dir)
    except ImportError as e:  # (no matplotlib: the tables are written all the same)
        assert "were written" in str(e)
    assert (sweep_dir / "figure2.md").is_file() and (sweep_dir / "figure2.csv").is_file()
    (sweep_dir / "sweep.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="sweep.json: not a sweep's record"):
        write_report(sweep_dir, tmp_path / "r")
    (sweep_dir / "sweep.json").write_text(json.dumps({"grid": 5}))
    with pytest.raises(ValueError, match="sweep.json: not a sweep's record"):
        write_report(sweep_dir, tmp_path / "r")
    parts = tmp_path / "parts"
    for name, ce in (("baseline-s0", 4.5), ("swa-64-s0", "4.4")):
        (parts / name).mkdir(parents=True)
        (parts / name / "eval.json").write_text(json.dumps({"val_ce": ce, "seq_len": 16}))
    with pytest.raises(ValueError, match="no sweep.json says what sweep this is"):
        write_report(parts, tmp_path / "r")
    rows, _ = collect_parts(parts)
    assert [r["part"] for r in rows] == ["baseline"]
    assert "swa-64-s0: its final val_ce is '4.4'" in capsys.readouterr().err


def test_the_parts_table_prices_runs_with_the_current_cost_model():
    """The committed swa-64 runs stored the FLOPs of a cost model that costed a window block as a full one; the
    parts table read them (it showed the baseline's FLOPs). It prices each run from its config, as `collect`."""
    from midlayer.config import ModelConfig, from_dict
    from midlayer.experiments.plot import collect_parts
    from midlayer.model.flops import forward_flops

    root = Path(__file__).parent.parent / "sweeps" / "parts"
    run = root / "swa-64-s0"
    stored = json.loads((run / "eval.json").read_text())
    cfg = from_dict(ModelConfig, json.loads((run / "config.json").read_text())["model"])
    now = forward_flops(cfg, stored["seq_len"]).total
    assert cfg.sliding_window == 64 and now < stored["flops_per_seq"]
    rows = {r["part"]: r for r in collect_parts(root)[0]}
    assert rows["swa-64"]["flops_per_token"] == pytest.approx(now / stored["seq_len"])
    assert rows["swa-64"]["flops_per_token"] < rows["baseline"]["flops_per_token"]


def test_sweep_help_names_every_grid_and_print_config_checks_the_names(capsys):
    """`sweep --help` listed five of the seven grids (not cpu-seeds, which the docs run); --print-config printed
    the settings of a grid, or of runs, that do not exist (exit 0), where the command refuses them."""
    from midlayer.commands.experiments import GRID_HELP

    assert sorted(GRID_HELP) == sorted(GRIDS)
    assert cli.main(["sweep", "nosuch", "--print-config"]) == 2
    assert "unknown grid 'nosuch'" in capsys.readouterr().err
    assert cli.main(["sweep", "cpu", "--only", "nosuch", "--print-config"]) == 2
    assert "grid 'cpu' has no run 'nosuch'" in capsys.readouterr().err
    assert cli.main(["sweep", "cpu", "--only", "dense-1", "--print-config"]) == 0

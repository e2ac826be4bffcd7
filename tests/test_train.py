"""Training loop: schedule, learning, exact resume, DDP == single process, checkpoint refusals, CLI surface."""

import dataclasses
import json
import math
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from midlayer import cli
from midlayer.commands import options
from midlayer.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from midlayer.config import TrainConfig, get_preset
from midlayer.data.shards import write_shard
from midlayer.train.loop import NonFiniteLossError, lr_factor, router_lr_factor, train


def synthetic_shards(tmp: Path, vocab: int = 512, n: int = 40_000) -> str:
    """A learnable stream: mostly 'next = (prev * 7 + 3) % vocab', with 10% random tokens."""
    rng = np.random.default_rng(0)
    toks = np.empty(n, dtype=np.int64)
    toks[0] = 1
    noise = rng.random(n) < 0.1
    rand = rng.integers(0, vocab, n)
    for i in range(1, n):
        toks[i] = rand[i] if noise[i] else (toks[i - 1] * 7 + 3) % vocab
    d = tmp / "shards"
    d.mkdir(exist_ok=True)
    write_shard(d / "syn_train_000.bin", toks[: n * 3 // 4])
    write_shard(d / "syn_val_000.bin", toks[n * 3 // 4:])
    return str(d / "*.bin")


def debug_configs(tmp: Path, model: dict | None = None, **train_kw):
    data = synthetic_shards(tmp)
    return get_preset("debug", model=model or {}, train=dict(data=data, out_dir=str(tmp / "run"), **train_kw))


# ----------------------------------------------------------------------------------------- schedule
def test_lr_schedule_values_by_hand():
    cfg = TrainConfig(steps=100, warmup_frac=0.1, warmup_start_factor=0.1, lr=1.0)
    assert lr_factor(0, cfg) == pytest.approx(0.1)  # warmup starts at 0.1 x lr
    assert lr_factor(5, cfg) == pytest.approx(0.1 + 0.9 * 5 / 10)
    assert lr_factor(10, cfg) == pytest.approx(1.0)  # end of warmup: full lr
    assert lr_factor(55, cfg) == pytest.approx(0.5)  # half way through the cosine: cos(pi/2) -> 0.5
    assert lr_factor(99, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert lr_factor(100, cfg) == pytest.approx(0.0, abs=1e-12)  # end of training


def test_router_lr_floor_holds_the_routers_lr_after_warmup_and_trains_them_in_their_own_group(tmp_path):
    """router_lr_floor: the routers' multiplier is the schedule's until warm-up ends, then never below the
    floor (by hand); in a run the routers' group ends at lr x floor while the rest ends at the schedule's."""
    cfg = TrainConfig(steps=100, warmup_frac=0.1, warmup_start_factor=0.1, lr=1.0, router_lr_floor=0.3)
    assert router_lr_factor(5, cfg) == pytest.approx(0.55)  # warm-up as for every parameter
    assert router_lr_factor(55, cfg) == pytest.approx(0.5)  # above the floor: the cosine
    assert router_lr_factor(99, cfg) == pytest.approx(0.3) and router_lr_factor(100, cfg) == pytest.approx(0.3)
    m, s, t = debug_configs(tmp_path, steps=6, ckpt_every=6, router_lr_floor=1.0)
    train(m, s, t, progress=False)
    groups = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])["optimizer"]["param_groups"]
    assert len(groups) == 2 and len(groups[1]["params"]) == 2 * (m.n_layers // 2)  # each router's weight, bias
    assert groups[1]["lr"] == pytest.approx(t.lr) and groups[0]["lr"] == pytest.approx(t.lr * lr_factor(6, t))


# ------------------------------------------------------------------------------------------ learning
def test_loss_decreases_on_tiny_preset(tmp_path):
    m, s, t = get_preset("tiny", train=dict(data=synthetic_shards(tmp_path), out_dir=str(tmp_path / "run"),
                                            steps=30, batch_size=8, micro_batch_size=8, seq_len=64,
                                            eval_tokens=4096, log_every=1))
    m.vocab_size = 512
    res = train(m, s, t, progress=False)
    import json
    ce = [json.loads(line)["ce"] for line in open(tmp_path / "run" / "metrics.jsonl") if '"ce"' in line]
    assert len(ce) == 30
    assert np.mean(ce[-5:]) < np.mean(ce[:3]) - 1.0, ce
    assert res["val_ce"] < ce[0] - 1.0
    assert res["finished"] and 0.0 <= res["mean_sparsity"] <= 1.0
    assert (tmp_path / "run" / "eval.json").exists()


# ----------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("gating", [True, False])
def test_same_command_seed_and_machine_give_identical_weights(tmp_path, gating):
    """Issue 14: the noise of gated runs is measured across seeds and CPUs; on one machine, one seed must give
    the same bits (two fresh runs of the same configs, every parameter and controller coefficient equal)."""
    m, s, t = debug_configs(tmp_path, steps=6, ckpt_every=6)
    m.gating = gating
    finals = []
    for name in ("a", "b"):
        cfg = TrainConfig(**{**t.__dict__, "out_dir": str(tmp_path / name)})
        train(m, s, cfg, progress=False)
        finals.append(load_checkpoint(list_checkpoints(tmp_path / name)[-1]))
    a, b = finals
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    if gating:
        assert torch.equal(a["controller"]["alpha"], b["controller"]["alpha"])



def test_micro_batches_change_neither_the_logged_numbers_nor_the_weights(tmp_path):
    """Gradient accumulation (module docstring, step 2): each micro-batch's loss is divided by their number, so
    4 micro-batches of 1 sequence give the gradient, its norm (which --grad-clip compares), the logged losses and
    the weights that one micro-batch of 4 gives, up to float rounding. Without the division the norm was 4x and
    the clip point moved. A gated model, so the controller's regulariser is in the sum too."""
    logs, weights = [], []
    for micro in (4, 1):
        m, s, t = debug_configs(tmp_path, {"gating": True}, steps=3, batch_size=4, micro_batch_size=micro,
                                log_every=1)
        t = TrainConfig(**{**t.__dict__, "out_dir": str(tmp_path / f"mb{micro}")})
        train(m, s, t, progress=False)
        rows = [json.loads(line) for line in (tmp_path / f"mb{micro}" / "metrics.jsonl").read_text().splitlines()]
        logs.append([(r["step"], r["ce"], r["reg_loss"], r["grad_norm"]) for r in rows if "grad_norm" in r])
        weights.append(load_checkpoint(list_checkpoints(tmp_path / f"mb{micro}")[-1])["model"])
    assert [r[0] for r in logs[0]] == [r[0] for r in logs[1]] == [1, 2, 3]
    for a, b in zip(*logs):
        assert a[1:] == pytest.approx(b[1:], rel=1e-4, abs=1e-6), (a, b)
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], atol=1e-5, rtol=1e-4)


def test_init_perturb_moves_weights_by_the_relative_amount_and_keeps_the_data_order():
    from midlayer.model.transformer import Transformer
    from midlayer.train.loop import perturb_weights
    m, _, _ = get_preset("debug")
    torch.manual_seed(0)
    a = Transformer(m)
    b = Transformer(m)
    b.load_state_dict(a.state_dict())
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    perturb_weights(b, 1e-3, seed=0)
    assert torch.equal(torch.rand(3), before)  # the global generator (data, dropout) is untouched
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        nz = pa != 0
        rel = ((pb - pa)[nz] / pa[nz]).detach()
        assert torch.equal(pb[~nz], pa[~nz]), name  # zeros stay zero
        if nz.sum() > 100:  # relative change ~ N(0, 1e-3)
            assert 0.8e-3 < float(rel.std()) < 1.2e-3 and abs(float(rel.mean())) < 3e-4, name
    # at 1e-7 (below float32's spacing at 1) the product is formed in float64: most weights still move
    c = Transformer(m)
    c.load_state_dict(a.state_dict())
    perturb_weights(c, 1e-7, seed=0)
    w_a, w_c = a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight
    assert float((w_a != w_c).float().mean()) > 0.5


def test_controller_closed_loop_meets_every_target(tmp_path):
    """Issue 14: the controller with the proportional term (gamma 1e-2, kp 0.3) drives every block's mean gate
    to within delta of its target on a small model in 400 steps: targets [1.0, 0.5] (debug preset, 4 layers,
    2 routers). Measured on the training batches of the last 50 steps (what the controller sees) and on the
    final evaluation. At this size and budget the paper's rule misses: gamma 1e-3 ends at [0.765, 0.310],
    gamma 1e-2 alone at [1.000, 0.602] (docs/results/controller-cpu.md)."""
    import json
    m, s, t = debug_configs(tmp_path, steps=400, batch_size=16, micro_batch_size=16, lr=3e-3, log_every=1,
                            eval_tokens=4096)
    s = dataclasses.replace(s, controller="proportional", mu0=1.0, mu_final=0.5, gamma=1e-2, kp=0.3)
    res = train(m, s, t, progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"gate_mean/0"' in line]
    last = [r for r in rows if r["step"] > 350]
    assert len(last) == 50
    # Within delta on this machine (0.999/0.498 train, 0.999/0.494 val). Gated training amplifies last-bit
    # differences (docs/results/noise-cpu.md), so another CPU may land a little elsewhere: 2 delta, which the
    # paper's rule at this budget misses by 5-10x.
    for block, target in enumerate([1.0, 0.5]):
        train_mean = float(np.mean([r[f"gate_mean/{block}"] for r in last]))
        assert abs(train_mean - target) <= 2 * s.delta, (block, train_mean)
        assert abs(res["gate_mean"][block] - target) <= 2 * s.delta, (block, res["gate_mean"][block])


def test_controller_reads_held_out_statistics_by_hand(tmp_path):
    """control_holdout: eq. 6 moves alpha by gamma (mean - mu*) of the *held-out* control batch, measured in eval
    mode after the step's update -- recomputed here from the step-1 checkpoint and that batch; training batches
    never come from the held-out part; and the option is refused without an adaptive controller."""
    import json

    from midlayer.data.shards import TokenWindows, resolve_data
    from midlayer.model.transformer import Transformer
    from midlayer.common import cache_dir as default_cache_dir

    m, s, t = debug_configs(tmp_path, steps=1, ckpt_every=1, log_every=1, control_holdout=0.2, control_batch_size=4)
    s = dataclasses.replace(s, controller="proportional", mu0=1.0, mu_final=0.0, gamma=0.5, delta=0.0)
    train(m, s, t, progress=False)
    ckpt = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])
    model = Transformer(m)
    model.load_state_dict(ckpt["model"])
    files = resolve_data(t.data, default_cache_dir(), t.tokenizer_vocab, t.val_data)
    control = TokenWindows(files.train, t.seq_len, span=(0.8, 1.0))
    x, _ = control.batch(0, t.seed, 4, 0, 4)
    with torch.no_grad():
        mean = model.eval()(x).gate_stats.mean
    mu = torch.tensor([1.0, 0.0, 0.0, 1.0])  # debug preset: 4 blocks, targets linear 1 -> 0, mirrored
    assert torch.allclose(ckpt["controller"]["alpha"], 0.5 * (mean - mu), atol=1e-6)
    rec = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"control_gate_mean/0"' in line]
    assert rec[0]["control_gate_mean/1"] == pytest.approx(float(mean[1]), abs=1e-6)
    # the training part and the held-out part split every shard: [0, 0.8 n) and [0.8 n, n)
    train_part = TokenWindows(files.train, t.seq_len, span=(0.0, 0.8))
    for whole, a, b in zip(TokenWindows(files.train, t.seq_len).shards, train_part.shards, control.shards):
        cut = int(0.8 * len(whole))
        assert np.array_equal(a, whole[:cut]) and np.array_equal(b, whole[cut:])
    with pytest.raises(ValueError, match="span"):
        TokenWindows(files.train, t.seq_len, span=(0.5, 0.5))
    with pytest.raises(ValueError, match="control-holdout"):
        train(m, dataclasses.replace(s, controller="none"), dataclasses.replace(t, out_dir=str(tmp_path / "x")),
              progress=False)
    with pytest.raises(ValueError, match="control_holdout"):
        TrainConfig(control_holdout=1.0)


# -------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("gating", [True, False, "sampled", "router_reg", "control_holdout"])
def test_resume_reaches_identical_weights(tmp_path, gating):
    """gating "sampled": gate_values = "sampled", whose thresholds come from the global RNG (checkpointed);
    "router_reg": the controller's regulariser differentiated with the routers' inputs detached;
    "control_holdout": the controller reads held-out gate statistics (an extra eval-mode forward a step)."""
    m, s, t = debug_configs(tmp_path, steps=8, ckpt_every=2, keep_last=2,
                            control_holdout=0.1 if gating == "control_holdout" else 0.0)
    m.gating = bool(gating)
    if gating == "sampled":
        m.gate_values, m.gate_grad = "sampled", "straight_through"
    if gating == "router_reg":
        s.reg_grad, s.kp = "straight_through_routers", 1.0
    t_full = TrainConfig(**{**t.__dict__, "out_dir": str(tmp_path / "full")})
    train(m, s, t_full, progress=False)
    # A run "killed" after 3 steps, then resumed: the checkpoint at 3 carries optimizer, schedule, controller.
    part = train(m, s, t, progress=False, stop_after=3)
    assert part["step"] == 3 and not part["finished"]
    train(m, s, t, progress=False, resume=True)
    a = load_checkpoint(list_checkpoints(tmp_path / "full")[-1])
    b = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])
    assert a["step"] == b["step"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    if gating:
        assert a["controller"]["alpha"].abs().sum() > 0
        assert torch.equal(a["controller"]["alpha"], b["controller"]["alpha"])
    assert len(list_checkpoints(tmp_path / "full")) == 2  # keep_last


def test_resuming_a_finished_run_only_evaluates_and_writes_eval_json(tmp_path):
    m, s, t = debug_configs(tmp_path, steps=3)
    train(m, s, t, progress=False)
    (tmp_path / "run" / "eval.json").unlink()
    before = [p.read_bytes() for p in list_checkpoints(tmp_path / "run")]
    res = train(m, s, t, progress=False, resume=True)
    assert res["finished"] and (tmp_path / "run" / "eval.json").exists()
    assert [p.read_bytes() for p in list_checkpoints(tmp_path / "run")] == before


def test_a_torn_eval_json_is_an_unfinished_run_and_eval_json_is_written_whole(tmp_path, monkeypatch, capsys):
    """eval.json says a run is finished (sweep, demo, plot read it). A torn one (a write cut short) made every
    later `demo` fail on its JSON; it is now taken as unfinished, and the run resumes to evaluate it again.
    And it is written whole or not at all: a write that fails leaves the earlier file."""
    import midlayer.common as common
    from midlayer.experiments.demo import run_one

    out = tmp_path / "demo"
    first = run_one("debug", out, steps=2, progress=False)
    good = (out / "eval.json").read_text()
    (out / "eval.json").write_text(good[: len(good) // 2])
    again = run_one("debug", out, steps=2, progress=False)
    assert "is not valid JSON" in capsys.readouterr().out
    assert again["val_ce"] == first["val_ce"] and json.loads((out / "eval.json").read_text())["step"] == 2

    def full_disk(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(common.os, "fsync", full_disk)
    before = (out / "eval.json").read_text()
    m, s, t = get_preset("debug", train={"out_dir": str(out), "ckpt_every": 50, "steps": 2})
    with pytest.raises(OSError, match="No space left"):
        train(m, s, t, progress=False, resume=True)  # a finished run: evaluates and writes eval.json again
    assert (out / "eval.json").read_text() == before and not list(out.glob("*.tmp*"))


def test_fresh_run_refuses_to_overwrite_existing_checkpoints(tmp_path):
    m, s, t = debug_configs(tmp_path, steps=2)
    train(m, s, t, progress=False)
    before = {p: p.read_bytes() for p in list_checkpoints(tmp_path / "run")}
    with pytest.raises(CheckpointError, match="--resume"):
        train(m, s, t, progress=False)
    assert {p: p.read_bytes() for p in list_checkpoints(tmp_path / "run")} == before


def test_corrupt_or_mismatched_checkpoint_is_refused_and_nothing_overwritten(tmp_path):
    m, s, t = debug_configs(tmp_path, steps=4)
    train(m, s, t, progress=False, stop_after=2)
    ckpt = list_checkpoints(tmp_path / "run")[-1]
    good = ckpt.read_bytes()
    # mismatched model config
    m2 = type(m)(**{**m.__dict__, "dim": 64})
    with pytest.raises(CheckpointError, match="dim: 32 -> 64"):
        train(m2, s, t, progress=False, resume=True)
    assert ckpt.read_bytes() == good
    # truncated file
    ckpt.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        train(m, s, t, progress=False, resume=True)
    assert len(ckpt.read_bytes()) == len(good) // 2 and len(list_checkpoints(tmp_path / "run")) == 1
    # not a checkpoint at all
    torch.save({"hello": 1}, ckpt)
    with pytest.raises(CheckpointError, match="not a midlayer-checkpoint"):
        load_checkpoint(ckpt)



def test_the_checksum_covers_names_and_places_not_only_bytes(tmp_path):
    """A checkpoint whose bytes all survive but whose names or places changed is damaged too: a tensor's key
    renamed (its sorted place kept, so only the name differs), two tensors of one shape swapped, the old
    `model_sha256` of the weights alone (files before "sha256") with a name changed."""
    from midlayer.train.checkpoint import save_checkpoint, state_digest, weights_digest

    torch.manual_seed(0)
    state = {"model": {"a.weight": torch.randn(3, 2), "b.weight": torch.randn(3, 2)}, "step_extra": [1, 2]}
    path = save_checkpoint(tmp_path / "run", 1, state, {"model": {}, "sparsity": {}, "train": {}}, keep_last=1)
    good = torch.load(path, weights_only=False)
    load_checkpoint(path)
    renamed = {**good, "model": {"a.weight": good["model"]["a.weight"], "bz.weight": good["model"]["b.weight"]}}
    swapped = {**good, "model": {"a.weight": good["model"]["b.weight"], "b.weight": good["model"]["a.weight"]}}
    for bad in (renamed, swapped):
        torch.save(bad, path)
        with pytest.raises(CheckpointError, match="do not match their checksum"):
            load_checkpoint(path)
    assert state_digest({"m": {"w": 1}}) != state_digest({"m": {"v": 1}})
    w = {"a": torch.ones(2), "b": torch.zeros(2)}
    assert weights_digest(w) != weights_digest({"a": torch.ones(2), "c": torch.zeros(2)})
    assert weights_digest(w) != weights_digest({"a": torch.zeros(2), "b": torch.ones(2)})


def test_non_finite_loss_stops_without_saving(tmp_path, monkeypatch):
    import midlayer.train.loop as train_mod

    class Exploding(train_mod.Transformer):
        calls = 0

        def forward(self, *a, **kw):
            out = super().forward(*a, **kw)
            Exploding.calls += 1
            if Exploding.calls > 6 and self.training:  # from the 4th optimizer step (2 micro-batches each)
                out.loss = out.loss * float("nan")
            return out

    monkeypatch.setattr(train_mod, "Transformer", Exploding)
    m, s, t = debug_configs(tmp_path, steps=10, ckpt_every=2)
    with pytest.raises(NonFiniteLossError, match="step 3"):
        train(m, s, t, progress=False)
    ckpts = list_checkpoints(tmp_path / "run")
    assert [int(p.stem.split("_")[1]) for p in ckpts] == [2]
    load_checkpoint(ckpts[-1])  # finite weights


# ------------------------------------------------------------------------------------------------ DDP
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_two(worker, *args) -> None:
    """Two gloo processes running worker(rank, 2, port, *args) on a free port. The port is free when picked and
    bound by rank 0 a moment later: where another process (a parallel test worker) took it in between, the
    store fails with EADDRINUSE before any training, and the run starts again on another port."""
    for attempt in range(3):
        try:
            mp.spawn(worker, args=(2, _free_port(), *args), nprocs=2, join=True)
            return
        except mp.ProcessRaisedException as e:
            if "address already in use" not in str(e).lower() or attempt == 2:
                raise


_DROPOUT = dict(dropout=0.1, attn_dropout=0.1)
# every step logged, and a held-out control batch for the sparsity controller (each rank reads its half of it)
_DDP_TRAIN = dict(steps=4, batch_size=8, micro_batch_size=2, log_every=1, control_holdout=0.1, control_batch_size=4)


def test_setup_takes_rank_local_rank_and_world_from_torchrun(monkeypatch):
    """RANK is the global rank (rank 0 alone logs and writes checkpoints); LOCAL_RANK only picks the device. On a
    second node (RANK 3, LOCAL_RANK 1 of 4) the process is not the main one."""
    import torch.distributed as dist

    from midlayer.train import distributed as dist_utils
    calls = []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    info = dist_utils.setup("cpu")
    assert (info.rank, info.local_rank, info.world_size) == (3, 1, 4)
    assert not info.is_main and info.enabled and calls == [{"backend": "gloo"}]


def _ddp_worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import midlayer.train.loop as loop
    save = loop.save_checkpoint

    def spy(run_dir, step, *a, **kw):  # which ranks write checkpoints
        with open(Path(tmp) / f"saved-by-rank{rank}", "a") as f:
            f.write(f"{step}\n")
        return save(run_dir, step, *a, **kw)

    loop.save_checkpoint = spy
    m, s, t = debug_configs(Path(tmp), _DROPOUT, **_DDP_TRAIN)
    train(m, s, t, progress=False, device="cpu")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_ddp_two_gloo_processes_equal_single_process(tmp_path):
    """Two gloo ranks end where one process ends, with dropout too: each micro-batch's random draws are seeded by
    its place in the global batch (`micro_batch_seed`), so each rank draws its own masks (the same masks on every
    rank would differ from the one process's), and the one process draws the very masks of the two ranks. They
    log what one process logs: each step once (rank 0 alone), its CE the mean over both ranks, the control
    batch's statistics over both halves; and rank 0 alone writes checkpoints."""
    ddp_dir = tmp_path / "ddp"
    ddp_dir.mkdir()
    _spawn_two(_ddp_worker, str(ddp_dir))
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    m, s, t = debug_configs(single_dir, _DROPOUT, **_DDP_TRAIN)
    train(m, s, t, progress=False, device="cpu")
    assert (ddp_dir / "saved-by-rank0").read_text() == "4\n" and not (ddp_dir / "saved-by-rank1").exists()

    def records(run):
        return [r for r in map(json.loads, (run / "run" / "metrics.jsonl").open()) if "ce" in r]

    got, ref = records(ddp_dir), records(single_dir)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]  # each step logged once
    for x, y in zip(got, ref):
        assert x["ce"] == pytest.approx(y["ce"], rel=1e-5), x["step"]
        assert x["control_gate_mean/0"] == pytest.approx(y["control_gate_mean/0"], rel=1e-4), x["step"]
    a = load_checkpoint(list_checkpoints(ddp_dir / "run")[-1])
    b = load_checkpoint(list_checkpoints(single_dir / "run")[-1])
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], atol=1e-5, rtol=1e-4, msg=k)
    torch.testing.assert_close(a["controller"]["alpha"], b["controller"]["alpha"], atol=1e-7, rtol=1e-5)
    assert not torch.equal(a["model"]["output.weight"], get_init_output_weight(m))


def _fsdp_worker(rank: int, world: int, port: int, tmp: str, phase: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    m, s, t = debug_configs(Path(tmp), _T5, **_FSDP_TRAIN)
    if phase == "first":
        from torch.distributed.tensor import DTensor, Shard

        from midlayer.train import distributed as dist_utils
        from midlayer.model.transformer import Transformer
        dist_utils.setup("cpu")  # train() keeps this process group and tears it down at its end
        model = Transformer(m)
        full = {n: p.shape for n, p in model.named_parameters()}
        dist_utils.shard_model(model)
        for n, p in model.named_parameters():  # every parameter really sharded: this rank holds its dim-0 slice
            assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.shape == full[n], n
            chunk = -(-full[n][0] // world)  # torch.chunk's split: ceil(n / world) rows a rank, the last ones fewer
            assert p.to_local().shape[0] == max(0, min(full[n][0], (rank + 1) * chunk) - rank * chunk), n
        x = torch.randint(0, m.vocab_size, (2, 16))
        loss = model(x, x, return_logits=False).loss
        for i, block in enumerate(model.layers):  # between forward and backward a block holds its shard only
            for n, p in block.named_parameters():  # (reshard_after_forward: not the whole model's full weights)
                assert isinstance(p, DTensor), f"block {i} {n} still unsharded after its forward"
        loss.backward()
        train(m, s, t, progress=False, device="cpu", stop_after=2)  # "killed" after step 2
    else:
        train(m, s, t, progress=False, device="cpu", resume=True)


# 5 validation windows over 2 ranks in batches of 2: rank 0 runs 2 forwards, rank 1 one (+ one padding forward);
# grad_clip 0.05 clips every step (the debug model's gradient norm is above 1), so the norm over shards must be right
_FSDP_TRAIN = dict(steps=4, batch_size=8, micro_batch_size=2, ckpt_every=1, keep_last=10, eval_tokens=5 * 32,
                   router_lr_floor=0.5, grad_clip=0.05, parallel="fsdp")
# T5's position bias is registered after the routers, which router_lr_floor puts in a parameter group of their
# own: the sharded checkpoint must number Adam's moments group by group, as the unsharded optimizer does
_T5 = dict(pos_encoding="t5")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fsdp_two_gloo_processes_killed_and_resumed_equal_one_process(tmp_path):
    """--parallel fsdp (FSDP2) on 2 gloo processes, stopped after step 2 and resumed to step 4: weights, Adam
    moments (two parameter groups, a parameter registered after the second's: T5's position bias) and
    validation CE equal one process's run of the same configs; its step-2 checkpoint (full tensors) resumes in
    one process to the same result. Each block is resharded after its forward."""
    import shutil
    fsdp_dir = tmp_path / "fsdp"
    fsdp_dir.mkdir()
    _spawn_two(_fsdp_worker, str(fsdp_dir), "first")
    assert [int(p.stem.split("_")[1]) for p in list_checkpoints(fsdp_dir / "run")] == [1, 2]
    one_dir = tmp_path / "one-resumed"  # the sharded run's checkpoint, continued by a single process
    shutil.copytree(fsdp_dir, one_dir)
    _spawn_two(_fsdp_worker, str(fsdp_dir), "resume")
    m, s, t = debug_configs(one_dir, _T5, **_FSDP_TRAIN)
    train(m, s, dataclasses.replace(t, data=str(fsdp_dir / "shards" / "*.bin")), progress=False, device="cpu",
          resume=True)
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    m, s, t = debug_configs(single_dir, _T5, **_FSDP_TRAIN)
    train(m, s, t, progress=False, device="cpu")
    ref = load_checkpoint(list_checkpoints(single_dir / "run")[-1])
    ref_ce = json.loads((single_dir / "run" / "eval.json").read_text())["val_ce"]
    def norms(run):  # step -> logged gradient norm (before clipping)
        return {r["step"]: r["grad_norm"] for r in map(json.loads, (run / "run" / "metrics.jsonl").open())
                if "grad_norm" in r}
    assert min(norms(single_dir).values()) > 0.05  # clipping was active
    assert norms(fsdp_dir)[4] == pytest.approx(norms(single_dir)[4], rel=1e-4)  # the norm over all shards
    assert len(ref["optimizer"]["param_groups"]) == 2
    for run in (fsdp_dir, one_dir):
        got = load_checkpoint(list_checkpoints(run / "run")[-1])
        assert got["step"] == 4 and got["model"].keys() == ref["model"].keys()
        for k in ref["model"]:
            torch.testing.assert_close(got["model"][k], ref["model"][k], atol=1e-5, rtol=1e-4, msg=k)
        assert got["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
        assert got["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
        for i, st in ref["optimizer"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(got["optimizer"]["state"][i][name], st[name], atol=1e-6, rtol=1e-4,
                                           msg=f"{i} {name}")
        ce = json.loads((run / "run" / "eval.json").read_text())["val_ce"]
        assert ce == pytest.approx(ref_ce, abs=1e-5)
    assert not torch.equal(ref["model"]["output.weight"], get_init_output_weight(m))


def test_parallel_setting_is_checked():
    with pytest.raises(ValueError, match="parallel: must be one of"):
        TrainConfig(parallel="zero3")
    with pytest.raises(ValueError, match="parallel: must be one of"):
        TrainConfig(parallel="")


def get_init_output_weight(m):
    from midlayer.model.transformer import Transformer
    torch.manual_seed(0)
    return Transformer(m).output.weight.detach()


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_surface_is_frozen():
    """Renaming or dropping a flag breaks users' scripts: change this list deliberately."""
    CONFIG = ["--config", "--print-config"]  # issue 45: every command that runs takes a config file
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    flags = {name: sorted(o for a in p._actions for o in a.option_strings) for name, p in sub.choices.items()}
    # issue 44: demo, data and kernels (python -m midlayer.X before) joined the one command surface
    assert sorted(flags) == ["bench", "data", "demo", "distill", "eval", "flops", "generate", "kernels", "plot",
                             "presets", "serve", "sweep", "train", "train-draft", "train-gates"]
    # issue 45: the OpenAI-compatible server
    assert flags["serve"] == sorted(["-h", "--help", *CONFIG, "--model", "--checkpoint", "--weights", "--device", "--draft",
                                     "--tree", "--served-name", "--host", "--port", "--max-queue", "--max-batch",
                                     "--kv-cache",  # the KV cache's dtype (fp16 by default with q4)
                                     "--prefix-reuse",  # the continuous batch's prefix reuse (35th session)
                                     "--memory-rows"])  # rows that keep left requests' K/V (37th session)
    assert flags["demo"] == sorted(["-h", "--help", *CONFIG, "--steps", "--out-dir"])
    assert flags["kernels"] == sorted(["-h", "--help", *CONFIG])
    tools = next(a for a in sub.choices["data"]._actions if a.dest == "tool").choices
    assert sorted(tools) == ["corpus", "fineweb", "prompts", "recipe"]  # each passes its arguments to its module
    assert flags["distill"] == sorted(["-h", "--help", *CONFIG, "--model", "--out", "--max-new-tokens", "--batch-size", "--dtype",
                                       "--seed", "--prompts", "--split", "--weights", "--temperature", "--sample-seed",
                                       "--limit", "--no-progress", "--device"])
    model_flags = ["--attn-backend", "--dim", "--embed-norm", "--ffn-dim-multiplier", "--ffn-hidden", "--gate-eps",
                   "--gating", "--init-std", "--no-embed-norm", "--no-qkv-bias", "--qkv-bias",
                   "--max-seq-len", "--multiple-of", "--n-heads", "--n-kv-heads", "--n-layers", "--no-gating",
                   "--no-tie-embeddings", "--norm-eps", "--norm-placement", "--rope-theta", "--tie-embeddings",
                   "--vocab-size", "--norm-type", "--qk-norm", "--no-qk-norm", "--ffn-type", "--init-scheme",
                   "--dropout", "--attn-dropout", "--emb-dropout", "--pos-encoding", "--rope-scaling", "--rope-scale",
                   "--sliding-window", "--t5-buckets", "--t5-max-distance", "--moe-experts", "--moe-top-k",
                   "--moe-aux-coef", "--ssm-layers", "--ssm-state", "--ssm-expand", "--ssm-conv", "--ssm-dt-rank",
                   "--head-size", "--gate-attention", "--gate-grad", "--gate-values", "--scale-embeddings",
                   "--no-scale-embeddings",
                   "--full-attention-layers", "--rope-theta-local"]  # issue 46: Gemma 3's windowed / global blocks
    sparsity_flags = ["--alpha", "--beta", "--beta-max", "--controller", "--delta", "--gamma", "--kp", "--mu-final", "--mu0",
                      "--reg-grad"]
    train_flags = ["--adam-eps", "--batch-size", "--beta1", "--beta2", "--ckpt-every", "--compile", "--control-batch-size",
                   "--control-holdout", "--data",
                   "--dtype", "--eval-every", "--eval-tokens", "--grad-clip", "--grad-norm-spike", "--init-perturb", "--keep-last",
                   "--log-every", "--lr", "--micro-batch-size", "--no-compile", "--no-tensorboard", "--out-dir", "--parallel",
                   "--router-lr-floor", "--seed", "--seq-len", "--steps", "--tensorboard", "--tokenizer-vocab", "--val-data",
                   "--wandb", "--warmup-frac", "--warmup-start-factor", "--weight-decay"]
    assert flags["train"] == sorted(["-h", "--help", *CONFIG, "--resume", "--device", "--stop-after", "--no-progress"]
                                    + model_flags + sparsity_flags + train_flags)
    assert flags["flops"] == sorted(["-h", "--help", *CONFIG, "--seq-len", "--sparsity"] + model_flags)
    assert flags["eval"] == sorted(["-h", "--help", *CONFIG, "--eval-tokens", "--batch-size", "--device", "--output"])
    assert flags["sweep"] == sorted(["-h", "--help", *CONFIG, "--out-dir", "--launcher", "--nproc", "--only", "--data"])
    assert flags["plot"] == sorted(["-h", "--help", *CONFIG, "--out"])
    assert flags["generate"] == sorted(["-h", "--help", *CONFIG, "--model", "--checkpoint", "--prompt", "--chat", "--system",
                                        "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                                        "--no-skip", "--weights", "--device", "--draft", "--tree", "--stats",
                                        "--refresh-costs", "--gates", "--engine", "--graphs", "--kv-cache"])
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "bench").choices
    assert sorted(bench) == ["decode", "gates", "generate", "serve", "static", "train"]  # train: issue 44; serve: 45
    assert sorted(o for a in bench["serve"]._actions for o in a.option_strings) == sorted(
        ["-h", "--help", *CONFIG, "--model", "--weights", "--draft", "--clients", "--requests-per-client",
         "--max-tokens", "--prompts", "--no-llama-cpp", "--output"])
    assert sorted(o for a in bench["train"]._actions for o in a.option_strings) == sorted(
        ["-h", "--help", *CONFIG, "--steps", "--warmup", "--batch", "--seq-len", "--repeats", "--dtype", "--threads",
         "--no-grad-norm", "--only"])
    assert sorted(o for a in bench["generate"]._actions for o in a.option_strings) == sorted(
        ["-h", "--help", *CONFIG, "--what", "--model", "--new-tokens", "--preset", "--seq-len", "--fractions", "--skip-from",
         "--repeats", "--weights", "--prompt-lengths", "--device"])
    assert sorted(o for a in bench["decode"]._actions for o in a.option_strings) == sorted(
        ["-h", "--help", *CONFIG, "--model", "--drafts", "--layer-skip", "--tree", "--nodes", "--new-tokens", "--max-prompts",
         "--prompts", "--weights", "--no-transformers", "--output", "--device"])
    assert sorted(o for a in bench["static"]._actions for o in a.option_strings) == sorted(
        ["-h", "--help", *CONFIG, "--model", "--device", "--dtypes", "--graphs", "--drafts", "--nodes", "--also-nodes",
         "--eagle-k", "--eagle-depth",  # EAGLE-2's tree shape (46th session)
         "--anchors",  # hidden transfer's pseudo rows for some of the tree's rows only (65th session)
         "--new-tokens", "--max-prompts", "--no-transformers", "--no-dynamic", "--output"])
    assert sorted(o for a in bench["gates"]._actions for o in a.option_strings) == sorted(
        ["-h", "--help", *CONFIG, "--model", "--gates", "--data", "--static", "--prompts", "--records", "--new-tokens",
         "--weights", "--output"])
    draft_flags = ["--method", "--model", "--data", "--out-dir", "--k", "--layers", "--exit-layer", "--masked",
                   "--no-masked", "--schedule", "--epochs", "--lr", "--batch-tokens", "--seq-len", "--bf16", "--no-bf16",
                   "--seed", "--ckpt-every", "--max-eval-batches", "--eval-every", "--patience", "--curve-batches",
                   "--cache-gb", "--cache-dir", "--loss-positions", "--draft-vocab", "--gate-target", "--gate-gamma",
                   "--gate-kp", "--gate-beta-max", "--lora-rank", "--gate-values", "--router-norm", "--no-router-norm"]
    assert flags["train-draft"] == sorted(["-h", "--help", *CONFIG, "--stop-after", "--no-progress", "--methods", "--device",
                                           "--export-now", "--overwrite"]
                                          + draft_flags)
    assert flags["train-gates"] == sorted(["-h", "--help", *CONFIG, "--stop-after", "--no-progress", "--device", "--overwrite"]
                                          + draft_flags)


def test_cli_flags_override_preset_and_bad_values_are_clear(capsys):
    args = cli.build_parser().parse_args(["train", "tiny", "--mu-final", "0.25", "--no-gating", "--steps", "7"])
    over = options.overrides_from_args(args)
    m, s, t = get_preset("tiny", **over)
    assert (s.mu_final, m.gating, t.steps, m.dim) == (0.25, False, 7, 128)
    assert cli.main(["train", "tiny", "--mu-final", "1.5"]) == 2
    assert "--mu-final: a mean gate target must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_cli_flops_prints_breakdown(capsys):
    assert cli.main(["flops", "paper-12l", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "lm_head" in out and "total" in out


def test_logged_throughput_leaves_out_checkpoints_and_evaluations(tmp_path, monkeypatch):
    """tokens_per_s (logged every log_every steps) and the final train_tokens_per_s count training time only:
    on a clock where a step takes 1 s and each checkpoint or evaluation 100 s, both are batch_size x seq_len
    tokens a second (a step after an evaluation counted its time as the step's)."""
    from midlayer.train import loop

    clock = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])

    def taking(seconds, fn):
        def timed(self, *a):
            out = fn(self, *a)
            clock[0] += seconds
            return out
        return timed

    for name, seconds in (("forward_backward", 1.0), ("checkpoint", 100.0), ("evaluate", 100.0)):
        monkeypatch.setattr(loop.Trainer, name, taking(seconds, getattr(loop.Trainer, name)))
    m, s, t = debug_configs(tmp_path, steps=6, ckpt_every=2, eval_every=3, log_every=1)
    result = train(m, s, t, progress=False)
    rates = [r["tokens_per_s"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "tokens_per_s" in r]
    assert rates == [t.batch_size * t.seq_len] * 6 and result["train_tokens_per_s"] == t.batch_size * t.seq_len


def test_a_run_saved_before_new_config_fields_existed_still_resumes(tmp_path):
    """A checkpoint whose configs lack fields added later (their defaults are the older behaviour) and a
    config.json whose tuples are JSON lists are the same run, not "other settings"."""
    from midlayer.train.checkpoint import config_mismatch
    from midlayer.config import ModelConfig

    m, s, t = debug_configs(tmp_path, steps=4, ckpt_every=2)
    train(m, s, t, progress=False, stop_after=2)
    path = list_checkpoints(tmp_path / "run")[-1]
    ckpt = torch.load(path, weights_only=False)
    for field in ("norm_type", "ffn_type", "ssm_layers", "moe_experts", "pos_encoding"):
        del ckpt["configs"]["model"][field]
    for later in ("sha256", "data"):  # (what checkpoints hold since the 50th session: an older file has neither)
        del ckpt[later]
    torch.save(ckpt, path)
    assert train(m, s, t, progress=False, resume=True)["step"] == 4
    saved = {**dataclasses.asdict(m), "ssm_layers": []}
    assert config_mismatch(saved, dataclasses.asdict(m), ModelConfig) == []
    assert config_mismatch({"n_layers": 4}, {"n_layers": 6, "norm_type": "rmsnorm"}, ModelConfig) == \
        ["n_layers: 4 -> 6"]


@pytest.mark.parametrize("over", [dict(gating=True), dict(gating=False, moe_experts=4, moe_top_k=2)])
def test_micro_batch_losses_is_the_objective_and_the_benchmark_times_it(over):
    """train.micro_batch_losses = (the model's CE, the controller's loss on the gate statistics, coef x MoE aux),
    and `midlayer bench train`'s step (experiments/train_bench.py, which benchmarks/cuda_paths.py reuses) trains with exactly it."""

    from midlayer.model.transformer import Transformer
    from midlayer.model.sparsity import make_controller
    from midlayer.train.loop import micro_batch_losses

    model_cfg, sparsity_cfg, _ = get_preset("debug", model=over)
    torch.manual_seed(0)
    model = Transformer(model_cfg)
    controller = make_controller(sparsity_cfg, model_cfg.n_layers) if model_cfg.gating else None
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, model_cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    out, reg, moe = micro_batch_losses(model, x, y, model_cfg, sparsity_cfg, controller)
    ref = model(x, y, return_logits=False)
    assert torch.equal(out.loss, ref.loss)
    if controller is not None:
        assert torch.equal(reg, controller.loss(ref.gate_stats.mean, ref.gate_stats.var)) and reg.requires_grad
        assert float(moe) == 0.0
    else:
        assert float(reg) == 0.0 and torch.equal(moe, model_cfg.moe_aux_coef * ref.moe_aux) and float(moe.detach()) > 0

    from midlayer.experiments.train_bench import ours

    bench, bmodel = ours("debug", "k", "label", x, y, torch.float32, True, **over)
    first = bench.step()
    assert first == pytest.approx(float(out.loss.detach()), rel=0, abs=0)  # same seed-0 model, same objective
    w = next(bmodel.parameters()).detach().clone()
    bench.step()
    assert not torch.equal(w, next(bmodel.parameters()))  # the step trains

"""Training loop: one code path for a single process and `torchrun --nproc_per_node N` (DDP).

Per optimizer step (paper section 3.1 defaults, every value a TrainConfig field):
  1. the global batch of `batch_size` sequences is split over ranks, then into micro-batches of
     `micro_batch_size` (gradient accumulation); the windows are a pure function of (seed, step), so a
     run resumed at step s sees exactly the data an uninterrupted run would, and N ranks see exactly the
     batch one process would;
  2. loss = cross-entropy + the sparsity controller's regulariser (eq. 5) (+ moe_aux_coef x the experts'
     load-balancing loss for mixture-of-experts models), each divided by the number of
     micro-batches; DDP averages gradients over ranks;
  3. optional gradient clipping; the gradient norm is always measured and logged; a non-finite loss or
     gradient stops the run *before* the optimizer step, so no poisoned weights are ever saved;
  4. AdamW step, LR schedule step (linear warmup from warmup_start_factor x lr over warmup_frac of the
     steps, then cosine decay to 0);
  5. the controller's coefficients are updated from the gate statistics of the whole global batch,
     all-reduced over ranks (eq. 6), so every rank holds the same coefficients.

The random draws of a micro-batch (dropout, sampled hard gates) come from the global RNG seeded by (seed, step,
the micro-batch's place in the global batch), `micro_batch_seed`: like the data, a pure function of where the
micro-batch is, so a resumed run draws what an uninterrupted one does, and N ranks what one process draws when
its micro-batches are theirs (micro_batch_size at most batch_size / N, the same in both). Micro-batches split
otherwise draw other masks (the dropout kernels draw for a whole micro-batch): a run that draws
(`draws_randomly`) refuses another micro_batch_size on resume; without draws it is free.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from midlayer.common import atomic_write, autocast_context, cache_dir as default_cache_dir, json_safe, resolve_dtype
from midlayer.config import ModelConfig, SparsityConfig, TrainConfig
from midlayer.data.shards import check_vocabulary, resolve_data, TokenWindows
from midlayer.model.attention import FLEX_MIN_HEAD_DIM
from midlayer.model.flops import forward_flops
from midlayer.model.sparsity import ADAPTIVE_KINDS, GateStatsAccumulator, make_controller
from midlayer.model.transformer import Transformer
from midlayer.output_lock import OutputLock
from midlayer.train import distributed as dist_utils
from .checkpoint import (CheckpointError, config_mismatch, is_run_config, list_checkpoints, load_newest_checkpoint,
                         load_weights, remove_stale_temp_files, save_checkpoint)
from .evaluate import evaluate


class NonFiniteLossError(RuntimeError):
    pass


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says which checkpoint a `--resume` continues from."""


# TrainConfig fields a resumed run may change: they decide how the run is logged, checkpointed, split into
# micro-batches or compiled, not what it computes. Any other difference from the checkpoint's configs (the
# model, the controller, the optimiser, the schedule -- `steps` too --, the data, the evaluation) is refused,
# naming the flag: the checkpoint would otherwise be continued, or evaluated, as a run it is not.
FREE_ON_RESUME = ("micro_batch_size", "eval_every", "log_every", "ckpt_every", "keep_last", "out_dir", "compile",
                  "parallel", "grad_norm_spike", "tensorboard", "wandb")
# ... and these may change to recover from a divergence (what the non-finite-loss error suggests): the new
# value applies from the resumed step on; the change is printed and logged in metrics.jsonl.
RECOVERY_ON_RESUME = ("lr", "grad_clip")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")



def lr_factor(step: int, cfg: TrainConfig) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warmup from `warmup_start_factor` to 1 over
    `warmup_steps`, then cosine from 1 to 0 over the remaining steps (reaching 0 after the last step)."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.warmup_start_factor + (1.0 - cfg.warmup_start_factor) * step / w
    progress = (step - w) / max(1, cfg.steps - w)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def router_lr_factor(step: int, cfg: TrainConfig) -> float:
    """The routers' LR multiplier: `lr_factor`, held at or above `router_lr_floor` once warm-up is over."""
    f = lr_factor(step, cfg)
    return f if step < cfg.warmup_steps else max(f, cfg.router_lr_floor)



class MetricsLogger:
    """JSONL always (rank 0); TensorBoard and wandb when asked for. Other ranks log nothing."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, configs: dict, enabled: bool) -> None:
        self.enabled = enabled
        self.file = open(Path(run_dir) / "metrics.jsonl", "a") if enabled else None
        self.tb = self.wandb = None
        if enabled and cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("--tensorboard needs: pip install 'midlayer[tensorboard]'") from e
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
        if enabled and cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("--wandb needs: pip install 'midlayer[wandb]'") from e
            self.wandb = wandb.init(project=cfg.wandb, config=configs, dir=str(run_dir))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.file.flush()
        step = record.get("step", 0)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _configs(model_cfg: ModelConfig, sparsity_cfg: SparsityConfig, train_cfg: TrainConfig) -> dict[str, dict]:
    return {"model": asdict(model_cfg), "sparsity": asdict(sparsity_cfg), "train": asdict(train_cfg)}


@torch.no_grad()
def perturb_weights(model: torch.nn.Module, rel: float, seed: int) -> None:
    """w <- w (1 + rel z), z ~ N(0, 1) per weight, from a generator of its own (seeded by `seed`), so the
    global RNG -- dropout, data -- is untouched. With rel ~ 1e-7 (float32's unit roundoff is 6e-8) it stands
    in for the rounding differences of another CPU: how far a run moves under it measures how much training
    amplifies last-bit noise (issue 14). Zeros (biases at init) stay 0."""
    gen = torch.Generator().manual_seed((seed + 0x5EED) % 2**64)
    for p in model.parameters():
        z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        # in float64: 1 + 1e-7 z is not representable in float32 (its spacing above 1 is 1.2e-7)
        p.copy_((p.double() * (1 + rel * z)).to(p.dtype))


def draws_randomly(model: dict[str, Any]) -> bool:
    """Whether a model (its config as a dict) draws random numbers in training: dropouts, sampled gates."""
    return bool(model.get("dropout") or model.get("attn_dropout") or model.get("emb_dropout")
                or (model.get("gating") and model.get("gate_values") == "sampled"))


def micro_batch_seed(seed: int, step: int, offset: int) -> int:
    """The global RNG's seed for the micro-batch at `offset` (its first sequence's place in the global batch) of
    `step`: a 64-bit hash of the three (splitmix64's mixer), so that neighbouring micro-batches and steps get
    unrelated streams."""
    x = (0x243F6A8885A308D3 + seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9
         + offset * 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63


def micro_batch_losses(fwd: Callable, x: torch.Tensor, y: torch.Tensor, model_cfg: ModelConfig,
                       sparsity_cfg: SparsityConfig, controller: Any | None
                       ) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """THE training objective of one micro-batch: (out, reg, moe) with out.loss the LM cross-entropy, reg the
    sparsity controller's regulariser (gated models; zero otherwise) and moe the experts' load-balancing loss
    times `moe_aux_coef` (zero without experts). The step minimises out.loss + reg + moe. `fwd` is the model or
    its compiled / DDP / FSDP wrapper; call inside the autocast context. Used by the training loop and by the
    throughput benchmarks (`midlayer bench train`: experiments/train_bench.py; benchmarks/cuda_paths.py), so they time the same step."""
    out = fwd(x, y, return_logits=False)
    reg = torch.zeros((), device=x.device)
    if controller is not None:
        # eq. 4's statistics, differentiated as reg_grad says (same values: gating.GateStats.regulariser_inputs)
        reg = controller.loss(*out.gate_stats.regulariser_inputs(sparsity_cfg.reg_grad))
    moe = torch.zeros((), device=x.device)
    if out.moe_aux is not None:  # the experts' load-balancing loss (model.MoEFeedForward)
        moe = model_cfg.moe_aux_coef * out.moe_aux
    return out, reg, moe


def train(model_cfg: ModelConfig, sparsity_cfg: SparsityConfig, train_cfg: TrainConfig, *,
          resume: bool = False, device: str | None = None, cache_dir: Path | None = None,
          progress: bool = True, stop_after: int | None = None) -> dict[str, Any]:
    """Train (or resume) a run in `train_cfg.out_dir`; returns the final evaluation dict.

    `stop_after` ends the process's work after that many optimizer steps of this call (with a checkpoint),
    simulating a killed job for tests and letting long runs be cut into sessions.

    Ctrl-C raises `TrainingInterrupted` (a KeyboardInterrupt) whose message names the checkpoint to resume from.
    """
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1):
        raise ValueError(f"--stop-after: must be a positive number of steps, got {stop_after!r}")
    if device is not None:
        dev = dist_utils.resolve_device(device)  # a clear refusal, e.g. CUDA on a machine without it
        if dev.type == "cuda" and dev.index is None:  # bare "cuda": this process's GPU, as the default picks
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    info = dist_utils.setup(device)
    try:
        with ExitStack() as cleanup:  # closes the progress bar before an error or interruption is reported
            return _train(model_cfg, sparsity_cfg, train_cfg, info, resume, cache_dir or default_cache_dir(),
                          progress, stop_after, cleanup)
    except KeyboardInterrupt:
        last = list_checkpoints(Path(train_cfg.out_dir))
        raise TrainingInterrupted(
            f"continue from {last[-1]} by running the same command with --resume" if last else
            f"no checkpoint in {train_cfg.out_dir} yet, so nothing to resume from") from None
    finally:
        dist_utils.teardown()


# what a run writes beside its checkpoints (checkpoint.py, Trainer.finish, evaluate.py): a fresh run sets them aside
EARLIER_RUN_FILES = ("metrics.jsonl", "config.json", "eval.json", "extrapolation.json", "throughput.json")


def _refuse_foreign(run_dir: Path) -> None:
    """A fresh run goes only where a run of ours is, or nothing: a folder that holds a Hugging Face model, a
    draft or a sweep is refused before anything is written there (its config.json was replaced by ours)."""
    if not run_dir.is_dir():
        return
    theirs = sorted(p.name for p in run_dir.iterdir() if p.suffix == ".safetensors"
                    or p.name in ("draft.json", "train_state.pt", "sweep.json", "tokenizer.json"))
    config = run_dir / "config.json"
    if config.is_file():
        try:
            doc = json.loads(config.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            doc = None
        if not is_run_config(doc):
            theirs.insert(0, "config.json (not a midlayer run's)")
    if theirs:
        raise ValueError(f"--out-dir {run_dir} holds files that are not a training run's ({', '.join(theirs)}); "
                         "a run would overwrite them: choose another --out-dir")


def _set_aside_earlier(run_dir: Path) -> None:
    """A fresh run starts fresh: the files of an earlier run that left no checkpoint to resume (killed before its
    first, or finished and its checkpoints deleted) move aside as NAME.earlier-N.EXT, one N for them all, so that
    no plot or sweep reads its log or results as this run's, and nothing of it is lost."""
    found = [run_dir / name for name in EARLIER_RUN_FILES
             if (run_dir / name).is_file() and (run_dir / name).stat().st_size]
    if not found:
        return
    n = 1
    while any((run_dir / f"{p.stem}.earlier-{n}{p.suffix}").exists() for p in found):
        n += 1
    for p in found:
        os.replace(p, run_dir / f"{p.stem}.earlier-{n}{p.suffix}")
    print(f"note: {run_dir} held the files of an earlier run that left no checkpoint "
          f"({', '.join(p.name for p in found)}); moved them to *.earlier-{n}.*", file=sys.stderr)


def _check_resume(ckpt: dict[str, Any], path: Path, configs: dict[str, dict]) -> dict[str, tuple[Any, Any]]:
    """Refuse to resume `ckpt` (read from `path`) under other settings; returns the recovery settings that
    change (field -> (saved, now))."""
    saved = ckpt["configs"]
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), dict) for k in configs):
        raise CheckpointError(f"cannot resume {path}: its configs are not midlayer's model/sparsity/train configs")
    diff = (config_mismatch(saved["model"], configs["model"], ModelConfig)
            + config_mismatch(saved["sparsity"], configs["sparsity"], SparsityConfig))
    skip = FREE_ON_RESUME + RECOVERY_ON_RESUME
    if draws_randomly(configs["model"]):  # (its micro-batches' places seed the draws: module docstring)
        skip = tuple(k for k in skip if k != "micro_batch_size")
    diff += config_mismatch({k: v for k, v in saved["train"].items() if k not in skip},
                            {k: v for k, v in configs["train"].items() if k not in skip}, TrainConfig)
    if diff:
        raise CheckpointError(
            f"cannot resume {path}: it was made with other settings (the run's -> this command's): "
            + "; ".join(_flag(d) for d in diff)
            + f". Pass the run's own values (see {path.parent / 'config.json'}) or choose another --out-dir")
    return {k: (saved["train"].get(k), configs["train"][k]) for k in RECOVERY_ON_RESUME
            if saved["train"].get(k) != configs["train"][k]}


def shard_digest(path: Path, blocks: int = 16, block: int = 1 << 16) -> str:
    """A sha256 of `blocks` blocks of `block` bytes spread evenly over a shard (all of it when it is smaller):
    a shard written again with other tokens keeps its size (every FineWeb shard has the same), so the name and
    size alone let a resume train on other data. A sample, not the whole file: 1 MiB read per shard."""
    import hashlib

    size, h = path.stat().st_size, hashlib.sha256()
    with open(path, "rb") as f:
        if size <= blocks * block:
            h.update(f.read())
        else:
            for i in range(blocks):
                f.seek((size - block) * i // (blocks - 1))
                h.update(f.read(block))
    return h.hexdigest()[:16]


def data_record(train: list[Path], val: list[Path]) -> dict[str, list[list]]:
    """The shards a run reads, by name, size in bytes and `shard_digest`, in order (what a checkpoint keeps:
    `--data` is a glob, and a glob that matches other files on resume, or a shard written again, would silently
    change the data of every later step)."""
    return {split: [[p.name, p.stat().st_size, shard_digest(p)] for p in paths]
            for split, paths in (("train", train), ("val", val))}


def _check_data(saved: dict[str, list[list]], now: dict[str, list[list]], path: Path) -> None:
    """Refuse to resume `path` over other shards than those its run read (CheckpointError naming them). A
    checkpoint of an older version kept no digest: its shards are compared by name and size."""
    for split in ("train", "val"):
        was = [tuple(x) for x in saved.get(split, [])]
        got = [tuple(x)[:len(w)] for x, w in zip(now[split], was)] + [tuple(x) for x in now[split][len(was):]]
        if was != got:
            named_was, named_got = {x[:2] for x in was}, {x[:2] for x in got}  # (name, size)
            gone = [f"{x[0]} ({x[1]} bytes{', other content' if x[:2] in named_got else ''})"
                    for x in was if x not in got]
            new = [f"{x[0]} ({x[1]} bytes)" for x in got if x[:2] not in named_was]
            what = "; ".join(x for x in (gone and "no longer " + ", ".join(gone[:3]),
                                         new and "now also " + ", ".join(new[:3])) if x) or "their order changed"
            raise CheckpointError(f"cannot resume {path}: its run read other {split} shards ({what}). Give it the "
                                  "shards it was trained on, or choose another --out-dir")


def _train(model_cfg: ModelConfig, sparsity_cfg: SparsityConfig, cfg: TrainConfig, info: dist_utils.DistInfo,
           resume: bool, cache_dir: Path, progress: bool, stop_after: int | None, cleanup: ExitStack
           ) -> dict[str, Any]:
    trainer = Trainer(model_cfg, sparsity_cfg, cfg, info, cleanup)
    trainer.check_settings()
    trainer.open_run(resume)
    trainer.load_data(cache_dir)
    trainer.build()
    trainer.start_logging(progress)
    return trainer.run(stop_after)


class Trainer:
    """One training run as named steps (torchtitan's trainer shape): set-up (`check_settings`, `open_run`,
    `load_data`, `build`, `start_logging`), then per optimizer step `forward_backward`, `optimizer_step`,
    `update_controller` and `log_step`, with `evaluate` and `checkpoint` on their schedules, and `finish`.
    The order of the steps is the module docstring's 1-5; `run` is the loop."""

    def __init__(self, model_cfg: ModelConfig, sparsity_cfg: SparsityConfig, cfg: TrainConfig,
                 info: dist_utils.DistInfo, cleanup: ExitStack) -> None:
        self.model_cfg, self.sparsity_cfg, self.cfg, self.info, self.cleanup = model_cfg, sparsity_cfg, cfg, info, cleanup
        self.dev, self.world, self.rank = info.device, info.world_size, info.rank
        self.run_dir = Path(cfg.out_dir)
        self.configs = _configs(model_cfg, sparsity_cfg, cfg)
        self.per_rank = cfg.batch_size // self.world
        self.fsdp = info.enabled and cfg.parallel == "fsdp"
        self.bar = None

    # ------------------------------------------------------------------------------------------ set-up
    def check_settings(self) -> None:
        """Refuse settings that cannot train, before anything is read or written."""
        model_cfg, sparsity_cfg, cfg, world = self.model_cfg, self.sparsity_cfg, self.cfg, self.world
        if cfg.batch_size % world or self.per_rank % cfg.micro_batch_size:
            raise ValueError(f"--batch-size {cfg.batch_size} must split into {world} ranks x whole micro-batches of "
                             f"--micro-batch-size {cfg.micro_batch_size}")
        self.accum = self.per_rank // cfg.micro_batch_size
        if cfg.seq_len > model_cfg.max_seq_len:
            raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's --max-seq-len {model_cfg.max_seq_len}")
        if cfg.data == "shakespeare" and cfg.tokenizer_vocab > model_cfg.vocab_size:  # (known before the BPE trains)
            raise ValueError(f"--vocab-size {model_cfg.vocab_size} is smaller than the tokenizer's "
                             f"--tokenizer-vocab {cfg.tokenizer_vocab}")
        if model_cfg.gating and model_cfg.gate_values != "soft" and model_cfg.gate_grad == "exact":
            raise ValueError(f"--gate-values {model_cfg.gate_values}: rounded gates have no exact gradient (0 almost "
                             "everywhere), the routers would never move; use --gate-grad straight_through")
        if cfg.control_holdout > 0:
            if not (model_cfg.gating and sparsity_cfg.controller in ADAPTIVE_KINDS):
                raise ValueError(f"--control-holdout {cfg.control_holdout}: held-out gate statistics feed an adaptive "
                                 f"sparsity controller ({', '.join(ADAPTIVE_KINDS)}) of a gated model; this run has "
                                 f"{'controller ' + repr(sparsity_cfg.controller) if model_cfg.gating else 'no gates'}")
            if cfg.control_batch_size % world:
                raise ValueError(f"--control-batch-size {cfg.control_batch_size} must split evenly over {world} ranks")
        if self.fsdp and model_cfg.moe_experts:
            raise ValueError("--parallel fsdp: mixture-of-experts models are not supported (an expert that no token "
                             "of a micro-batch picks gets no gradient, which FSDP's reduce-scatter cannot skip as "
                             "DDP's find_unused_parameters does); use --parallel ddp")
        if model_cfg.attn_backend == "flex" and self.dev.type != "cuda":
            raise ValueError(f"--attn-backend flex: FlexAttention cannot train on {self.dev.type} (no backward pass "
                             "there); use --attn-backend auto or sdpa")
        if model_cfg.attn_backend == "flex" and model_cfg.head_dim < FLEX_MIN_HEAD_DIM:
            raise ValueError(f"--attn-backend flex: the compiled FlexAttention kernel on CUDA needs a head size of at "
                             f"least {FLEX_MIN_HEAD_DIM}, this model's is {model_cfg.head_dim}; use --attn-backend "
                             "auto (SDPA there) or sdpa")
        for parent in (self.run_dir, *self.run_dir.parents):  # the first part of --out-dir that exists: a folder
            if parent.exists():
                if not parent.is_dir():
                    raise ValueError(f"--out-dir {self.run_dir}: {parent} is a file, not a folder")
                break

    def open_run(self, resume: bool) -> None:
        """Refuse to clobber or to resume something else (decided before anything is written), then hold the
        run folder's output lock (output_lock.py)."""
        run_dir = self.run_dir
        self.existing = list_checkpoints(run_dir)
        self.ckpt = None
        self.changed: dict[str, tuple[Any, Any]] = {}
        if resume and self.existing:
            self.ckpt = load_newest_checkpoint(self.existing, map_location=self.dev)
            self.changed = _check_resume(self.ckpt, self.existing[-1], self.configs)
        elif resume:
            raise CheckpointError(f"--resume: {run_dir} holds no checkpoint (ckpt_*.pt) to resume from; check "
                                  "--out-dir, or leave out --resume to start a new run there")
        elif self.existing:
            raise CheckpointError(f"{run_dir} already holds checkpoints ({self.existing[-1].name}); pass --resume to "
                                  "continue that run or choose another --out-dir")
        else:
            _refuse_foreign(run_dir)
        if self.info.is_main:  # one writer per run folder, from before anything is written in it
            self.cleanup.enter_context(OutputLock(run_dir, "train"))
            if self.ckpt is None:
                _set_aside_earlier(run_dir)

    def load_data(self, cache_dir: Path) -> None:
        """The token windows; rank 0 builds the caches first so that ranks never race on them."""
        cfg = self.cfg
        if self.info.is_main:
            files = resolve_data(cfg.data, cache_dir, cfg.tokenizer_vocab, cfg.val_data)
        dist_utils.barrier()
        if not self.info.is_main:
            files = resolve_data(cfg.data, cache_dir, cfg.tokenizer_vocab, cfg.val_data)
        if files.vocab_size is not None and files.vocab_size > self.model_cfg.vocab_size:
            raise ValueError(f"--vocab-size {self.model_cfg.vocab_size} is smaller than the tokenizer's "
                             f"{files.vocab_size}")
        if files.vocab_size is None:  # (.bin shards of a tokenizer midlayer does not know: read their ids)
            check_vocabulary(files.train + files.val, self.model_cfg.vocab_size, cache_dir)
        self.data_record = data_record(files.train, files.val)
        if self.ckpt is not None and "data" in self.ckpt:
            _check_data(self.ckpt["data"], self.data_record, self.existing[-1])
        self.train_windows = TokenWindows(files.train, cfg.seq_len)
        self.control_windows = None
        if cfg.control_holdout > 0:  # the end of every shard is never trained on: the controller reads it
            cut = 1.0 - cfg.control_holdout
            self.train_windows = TokenWindows(files.train, cfg.seq_len, span=(0.0, cut))
            self.control_windows = TokenWindows(files.train, cfg.seq_len, span=(cut, 1.0))
        self.val_windows = TokenWindows(files.val, cfg.seq_len)

    def build(self) -> None:
        """Model, optimizer, schedule and controller (the same seed on every rank: the same initial weights),
        restored from the checkpoint when resuming; then the compiled / DDP wrapper the steps call."""
        model_cfg, cfg, dev, ckpt = self.model_cfg, self.cfg, self.dev, self.ckpt
        torch.manual_seed(cfg.seed)
        model = Transformer(model_cfg)
        if cfg.init_perturb > 0:
            perturb_weights(model, cfg.init_perturb, cfg.seed)
        model = model.to(dev)
        model.check_inputs = dev.type == "cpu"  # the range check syncs with the GPU; data ids are known-good
        if ckpt is not None:  # full tensors, loaded before sharding (every rank reads the checkpoint)
            load_weights(model, ckpt, self.existing[-1])
        if self.fsdp:
            dist_utils.shard_model(model)  # before the optimizer: it must hold the sharded parameters
        self.dtype = resolve_dtype(cfg.dtype, dev)
        factors = [lambda s: lr_factor(s, cfg)]
        groups: Any = model.parameters()
        if cfg.router_lr_floor > 0 and model.routers is not None:  # the routers in a group of their own
            ids = {id(p) for p in model.routers.parameters()}
            groups = [{"params": [p for p in model.parameters() if id(p) not in ids]},
                      {"params": list(model.routers.parameters())}]
            factors.append(lambda s: router_lr_factor(s, cfg))
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factors)  # one factor per parameter group
        controller = make_controller(self.sparsity_cfg, model_cfg.n_layers).to(dev) if model_cfg.gating else None
        self.model, self.opt, self.sched, self.controller = model, opt, sched, controller
        self.start = 0
        if ckpt is not None:
            self._restore(factors)
        run_model = torch.compile(model) if cfg.compile else model
        # An expert that no token of a micro-batch picked gets no gradient: DDP must then not wait for it.
        self.ddp = DDP(run_model, device_ids=[dev.index] if dev.type == "cuda" else None,
                       find_unused_parameters=model_cfg.moe_experts > 0) if self.info.enabled and not self.fsdp else None
        self.fwd = self.ddp if self.ddp is not None else run_model

    def _restore(self, factors: list[Callable[[int], float]]) -> None:
        """The training state of the checkpoint resumed: refused in one line (CheckpointError naming the file)
        where it lacks a part or a part does not fit this run (an optimizer moment of another shape would load,
        then fail inside the first step)."""
        ckpt, opt, sched, path = self.ckpt, self.opt, self.sched, self.existing[-1]
        need = ["optimizer", "scheduler", "rng_cpu"] + (["controller"] if self.controller is not None else [])
        missing = [k for k in need if k not in ckpt]
        if missing:
            raise CheckpointError(f"cannot resume {path}: it holds no {', '.join(missing)} state (weights alone can "
                                  "be evaluated or fine-tuned from, not resumed)")
        try:
            if self.fsdp:
                dist_utils.load_optimizer_state(self.model, opt, ckpt["optimizer"])
            else:
                opt.load_state_dict(ckpt["optimizer"])
                for p, st in opt.state.items():
                    bad = [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape != p.shape]
                    if bad:
                        raise ValueError(f"optimizer state {bad[0]} of shape {tuple(st[bad[0]].shape)} for a "
                                         f"parameter of shape {tuple(p.shape)}")
            sched.load_state_dict(ckpt["scheduler"])
            if self.controller is not None:
                self.controller.load_state_dict(ckpt["controller"])
            torch.set_rng_state(ckpt["rng_cpu"].cpu())
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            first = " ".join(str(e).split())[:300]
            raise CheckpointError(f"cannot resume {path}: its training state does not fit this run "
                                  f"({type(e).__name__}: {first})") from None
        if self.dev.type == "cuda" and "rng_cuda" in ckpt:
            torch.cuda.set_rng_state(ckpt["rng_cuda"].cpu())
        self.start = int(ckpt["step"])
        if "lr" in self.changed:  # the optimizer and scheduler states carry the run's lr: apply this command's
            sched.base_lrs = [self.cfg.lr for _ in opt.param_groups]
            for group, factor in zip(opt.param_groups, factors):
                group["initial_lr"] = self.cfg.lr
                group["lr"] = self.cfg.lr * factor(self.start)

    def start_logging(self, progress: bool) -> None:
        """The run folder, notes on what resuming changed, the metrics log, the progress bar, the statistics."""
        run_dir, cfg, info, n = self.run_dir, self.cfg, self.info, self.model_cfg.n_layers
        if info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            stale = remove_stale_temp_files(run_dir)
            if stale:
                print(f"note: removed {len(stale)} temporary file(s) left in {run_dir} by an interrupted checkpoint "
                      f"write ({', '.join(p.name for p in stale)})", file=sys.stderr)
            if self.changed:
                print(f"note: resuming {self.existing[-1]} with " + "; ".join(
                    f"{_flag(k)} {now} (the run had {was})" for k, (was, now) in self.changed.items()), file=sys.stderr)
        self.logger = MetricsLogger(run_dir, cfg, self.configs, info.is_main)
        if self.ckpt is not None:
            self.logger.log({"event": "resumed", "step": self.start,
                             **({"changed": {k: list(v) for k, v in self.changed.items()}} if self.changed else {})})
        if progress and info.is_main:
            self.bar = self.cleanup.enter_context(tqdm(total=cfg.steps, initial=self.start,
                                                       desc=f"train {run_dir.name}", dynamic_ncols=True))
        self.acc = GateStatsAccumulator(n, device=self.dev) if self.controller is not None else None
        self.per_control = cfg.control_batch_size // self.world
        self.control_acc = GateStatsAccumulator(n, device=self.dev) if self.control_windows is not None else None
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        # the running mean of gradient norms that --grad-norm-spike compares with: resumed with the run (a
        # fresh mean flagged other steps after a resume than the run straight through)
        self.grad_norm_ema: float | None = None if self.ckpt is None else self.ckpt.get("grad_norm_ema")

    # ---------------------------------------------------------------------------------- the loop
    def run(self, stop_after: int | None) -> dict[str, Any]:
        """Optimizer steps from the checkpoint's step to `steps` (or `stop_after` of them), then `finish`."""
        cfg = self.cfg
        self.t_last, self.steps_since = time.perf_counter(), 0
        self.aside_total = 0.0  # seconds of checkpoints and evaluations: not training throughput
        t_start = self.t_last
        end = cfg.steps if stop_after is None else min(cfg.steps, self.start + stop_after)
        self.model.train()
        for step in range(self.start, end):
            losses = self.forward_backward(step)
            record = self.optimizer_step(step, *losses)
            self.update_controller(step, record)
            self.log_step(step, record, end)
            # (evaluation first: a run killed while it evaluates resumes from the step's previous checkpoint
            # and evaluates again; checkpointed first, the step's evaluation was lost for good)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                self._aside(self.evaluate, step + 1)
            if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0 and step + 1 < end:
                self._aside(self.checkpoint, step + 1)
        if self.bar is not None:
            self.bar.close()
        return self.finish(end, time.perf_counter() - t_start - self.aside_total)

    def _aside(self, fn: Callable[[int], Any], step: int) -> None:
        """fn(step) (a checkpoint, an evaluation), its time kept out of the logged training throughput."""
        t = time.perf_counter()
        fn(step)
        took = time.perf_counter() - t
        self.t_last += took  # (the logged interval starts that much later)
        self.aside_total += took

    def forward_backward(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-2: every micro-batch of this rank's share of the global batch, gradients accumulated (synced
        over ranks on the last one). Returns the summed (ce, reg, moe) losses; gate statistics go to `acc`."""
        cfg, dev, accum = self.cfg, self.dev, self.accum
        ce_sum, reg_sum, moe_sum = (torch.zeros((), device=dev) for _ in range(3))
        if self.acc is not None:
            self.acc.reset()
        for m in range(accum):
            offset = self.rank * self.per_rank + m * cfg.micro_batch_size
            x, y = self.train_windows.batch(step, cfg.seed, cfg.batch_size, offset, cfg.micro_batch_size)
            torch.manual_seed(micro_batch_seed(cfg.seed, step, offset))  # (dropout, sampled gates: module docstring)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            sync = nullcontext() if (self.ddp is None or m == accum - 1) else self.ddp.no_sync()
            if self.fsdp:  # reduce-scatter the gradients once per step, after the last micro-batch
                self.model.set_requires_gradient_sync(m == accum - 1)
            with sync:
                with autocast_context(dev, self.dtype):
                    out, reg, moe = micro_batch_losses(self.fwd, x, y, self.model_cfg, self.sparsity_cfg,
                                                       self.controller)
                if out.moe_aux is not None:
                    moe_sum += out.moe_aux.detach()
                ((out.loss + reg + moe) / accum).backward()
            ce_sum += out.loss.detach()
            reg_sum += reg.detach()
            if self.acc is not None:
                s = out.gate_stats
                self.acc.add(s.mean, s.var, s.zero_frac, s.n_tokens)
        return ce_sum, reg_sum, moe_sum

    def optimizer_step(self, step: int, ce_sum: torch.Tensor, reg_sum: torch.Tensor, moe_sum: torch.Tensor
                       ) -> dict[str, Any]:
        """Steps 3-4: losses averaged over ranks, the gradient norm measured (and clipped), a non-finite loss
        or gradient refused before the update, then AdamW and the schedule. Returns the step's record."""
        cfg, accum = self.cfg, self.accum
        ce = dist_utils.all_reduce_mean(ce_sum / accum)
        reg_v = dist_utils.all_reduce_mean(reg_sum / accum)
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = dist_utils.clip_grad_norm_(list(self.model.parameters()), clip)
        if not (torch.isfinite(ce) and torch.isfinite(grad_norm)):
            self.logger.log({"event": "non_finite", "step": step, "ce": ce.item(), "grad_norm": grad_norm.item()})
            self.logger.close()
            last = list_checkpoints(self.run_dir)
            raise NonFiniteLossError(
                f"non-finite loss or gradient at step {step} (ce={ce.item()}, grad_norm={grad_norm.item()}); "
                "stopped before the optimizer step, nothing saved. "
                + (f"Resume from {last[-1]} with --resume and a lower --lr or a --grad-clip."
                   if last else "Restart with a lower --lr or a --grad-clip."))
        lr = self.opt.param_groups[0]["lr"]  # the lr of this update (after sched.step() the next one's)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        record: dict[str, Any] = {"step": step + 1, "ce": ce.item(), "reg_loss": reg_v.item(),
                                  "grad_norm": grad_norm.item(), "lr": lr}
        if self.model_cfg.moe_experts:  # 1 = balanced experts, E = one expert takes every token
            record["moe_aux"] = dist_utils.all_reduce_mean(moe_sum / accum).item()
        return record

    def update_controller(self, step: int, record: dict[str, Any]) -> None:
        """Step 5: the controller's coefficients from the global batch's gate statistics (eq. 6), or from the
        held-out control batch; the statistics per first-half block go into the record."""
        if self.acc is None:
            return
        g_mean, g_var, g_zero = self.acc.reduce()
        half = self.model_cfg.n_layers // 2  # per first-half block: the second half mirrors it (eq. 2)
        if self.control_windows is None:
            self.controller.update(g_mean, g_var)  # eq. 6 on this step's training tokens, as the paper
        else:
            c_mean, c_var, _ = self.control_stats(step)
            self.controller.update(c_mean, c_var)
            record.update(**{f"control_gate_mean/{l}": float(c_mean[l]) for l in range(half)})
        record.update(sparsity=float(g_zero.mean()), gate_mean=float(g_mean.mean()),
                      **{f"gate_mean/{l}": float(g_mean[l]) for l in range(half)},
                      **{f"gate_var/{l}": float(g_var[l]) for l in range(half)},
                      **{f"gate_zero/{l}": float(g_zero[l]) for l in range(half)},
                      **{f"ctrl_{k}": v for k, v in self.controller.metrics().items()})

    def control_stats(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate statistics of the held-out control batch of `step` (eval mode: what inference would skip; no
        gradient, no random draw), over all ranks."""
        xc, _ = self.control_windows.batch(step, self.cfg.seed, self.cfg.control_batch_size,
                                           self.rank * self.per_control, self.per_control)
        self.model.eval()
        with torch.no_grad(), autocast_context(self.dev, self.dtype):
            st = self.fwd(xc.to(self.dev, non_blocking=True), return_logits=False).gate_stats
        self.model.train()
        self.control_acc.reset()
        self.control_acc.add(st.mean, st.var, st.zero_frac, st.n_tokens)
        return self.control_acc.reduce()

    def log_step(self, step: int, record: dict[str, Any], end: int) -> None:
        """Gradient-norm spikes, throughput every `log_every` steps, the metrics log and the progress bar."""
        cfg, bar = self.cfg, self.bar
        gn, ema = record["grad_norm"], self.grad_norm_ema
        if cfg.grad_norm_spike > 0 and ema is not None and gn > cfg.grad_norm_spike * ema:
            record["grad_norm_spike"] = gn / ema
            if bar is not None:
                bar.write(f"step {step + 1}: gradient-norm spike {gn:.3g} ({gn / ema:.1f}x the running mean)")
        self.grad_norm_ema = gn if ema is None else 0.95 * ema + 0.05 * gn
        self.steps_since += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == end:
            now = time.perf_counter()
            record["tokens_per_s"] = self.steps_since * self.tokens_per_step / (now - self.t_last)
            self.t_last, self.steps_since = now, 0
            self.logger.log(record)
        if bar is not None:
            post = {"ce": f"{record['ce']:.3f}"}
            if "tokens_per_s" in record:
                post["tok/s"] = f"{record['tokens_per_s']:.0f}"
            if "sparsity" in record:
                post["sparsity"] = f"{record['sparsity']:.3f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)

    # ------------------------------------------------------------------------ evaluation, checkpoints
    def evaluate(self, step: int) -> dict[str, Any]:
        res = evaluate(self.model, self.val_windows, eval_tokens=self.cfg.eval_tokens,
                       batch_size=self.cfg.micro_batch_size, device=self.dev, dtype=self.dtype, rank=self.rank,
                       world_size=self.world, equal_forwards=self.fsdp)
        res["step"] = step
        self.logger.log({"event": "eval", **res})
        return res

    def checkpoint(self, step: int) -> None:
        """Weights, optimizer, schedule, controller and RNG states at `step` (FSDP: gathered by a collective
        on every rank, written by rank 0)."""
        model, opt, info = self.model, self.opt, self.info
        if self.fsdp:
            model_state, opt_state = dist_utils.full_state(model, opt)
        elif info.is_main:
            model_state, opt_state = model.state_dict(), opt.state_dict()
        if info.is_main:
            state = {"model": model_state, "optimizer": opt_state, "scheduler": self.sched.state_dict(),
                     "rng_cpu": torch.get_rng_state(), "data": self.data_record, "grad_norm_ema": self.grad_norm_ema}
            if self.controller is not None:
                state["controller"] = self.controller.state_dict()
            if self.dev.type == "cuda":
                state["rng_cuda"] = torch.cuda.get_rng_state()
            save_checkpoint(self.run_dir, step, state, self.configs, self.cfg.keep_last)
        dist_utils.barrier()

    def finish(self, end: int, train_time: float) -> dict[str, Any]:
        """The last checkpoint; at the final step the evaluation, eval.json and the final log event."""
        start, cfg = self.start, self.cfg
        if end > start or not self.existing:
            self.checkpoint(end)
        result: dict[str, Any] = {"step": end, "finished": end == cfg.steps}
        if end > start:
            result["train_tokens_per_s"] = (end - start) * self.tokens_per_step / train_time
        if end == cfg.steps:  # finished (also when resuming a run whose last checkpoint is the final step)
            result = {**self.evaluate(end), **result}
            if self.info.is_main:
                result["flops_per_token_train_est"] = 3 * forward_flops(self.model_cfg, cfg.seq_len).total / cfg.seq_len
                atomic_write(self.run_dir / "eval.json",  # (whole or not at all: sweeps and plots read it back)
                             json.dumps(json_safe(result), indent=2, allow_nan=False).encode("utf-8"))
                self.logger.log({"event": "final", **result})
        self.logger.close()
        return result

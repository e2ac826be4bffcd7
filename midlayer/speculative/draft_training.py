"""`midlayer train-draft`: train a drafter (hidden transfer, Medusa heads, an early-exit head or an EAGLE head) on
a frozen base model by self-distillation, evaluate it on the held-out prompts, save only the draft weights.

Data: a distillation file (`midlayer.speculative.distill`: the base model's own responses, greedy or sampled, to the
prompt set of `midlayer.data.prompts` or the scaled one of `midlayer.data.prompt_recipe`), split into train / held-out by prompt. Every method sees the same batches (same
sequences, order and number of optimiser steps): the baselines get the same data and budget.

Loss (Wu et al. 2024 sec. 3.3, and the same KL for the baselines): forward KL from the base model's own
next-token distribution at the position a draft stands for to the draft's distribution, over the target
positions that count: with `loss_positions="response"` (default) those whose next token is a response token
(a drafter guesses only there at decode time; prompts -- SmolLM2's chat template repeats a fixed system
prompt -- are about a quarter of the tokens: 39 of 157 per record on average in the scaled distillation
set), with "all" every real (non-padding) one. Rows that do not count
skip the LM head and the KL (`drafters.gather_counted`), and hidden transfer builds no pseudo rows for
anchors whose targets all lie before the batch's first counted position (`hidden_transfer.anchor_range`).
With a draft vocabulary (`draft_vocab`, draft_vocab.py) the KL is over its tokens, the teacher renormalised
on them. The base is frozen; Adam on the draft parameters only. EAGLE adds its
feature regression: L = SmoothL1(fhat, f) + 0.1 KL (eagle.py; arXiv 2401.15077 sec. 4), with the paper's
U(-0.1, 0.1) input-feature noise drawn from a generator seeded by (seed, step), so resume stays exact.

Held-out metrics, written to `metrics.json` and into the draft's meta, over the drafts of *response*
tokens of the held-out records (`response_batches`):
  * `acc[d][r]`: fraction of held-out anchors whose rank-r draft candidate at depth d + 1 equals the base
    model's argmax there (given the true prefix). acc[d][0] is the draft top-1 accuracy of step d + 1
    (the paper's Fig. 3 probe); the rows feed `DraftTree.greedy_from_accuracies`. Early exit drafts
    autoregressively, so only its depth-1 accuracy is defined here; the decode benchmark measures every
    method's per-depth accuracy inside real decoding. EAGLE (also autoregressive) gets k depths: depth
    d + 1 chains its own predicted features from the anchor but is fed the TRUE tokens of the prefix
    (`eagle.eagle_forward`), i.e. it is scored on the path where every earlier draft was right.
  * hidden transfer only: `cosine[i][l]`, mean cosine similarity between the step-i pseudo state and the
    real state of the position it stands for, entering block l (l = t_i .. L, L = final residual) -- Fig. 4.

Frozen states (`FrozenStates`): what the frozen base computes for a batch below the draft -- the residual
entering block t_1 for hidden transfer, the final residual for Medusa / EAGLE, the final and exit residuals
for early exit -- is computed once and reused in later epochs (dense bases).

Training at scale:
  * learning curve: every `eval_every` steps the training loss on a fixed subset of `curve_batches`
    held-out records (response positions only) goes into `metrics["curve"]` with the mean training loss
    since the last evaluation;
  * early stopping: with `patience`, training stops after that many evaluations without a new best
    held-out loss, and the best evaluated weights are the ones saved (`best_step`);
  * `cache_gb` bounds the memory of the frozen states below; batches past it are recomputed each epoch
    (same values, only the cost differs), so 2M-token sets train in fixed memory; `cache_dir` keeps them
    on disk as well, so an epoch that starts in a later process (a later session) reads them back instead
    of running the base again (the base forward is ~75% of a CPU step);
  * bf16 autocast (`bf16`) is used only where bf16 is native (GPUs, AVX512-BF16 / AMX CPUs): emulated
    bf16 is slower than fp32.

Resume: every `ckpt_every` steps the draft weights, the Adam state and the step are saved atomically to
`out_dir/train_state.pt`; a rerun with the same settings continues from there (the batch sequence is a pure
function of the seed and the step, so the continuation is the one an uninterrupted run would have made).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from midlayer.common import atomic_write, json_safe
from midlayer.config import check_finite, GATE_VALUES
from midlayer.engine.draft_vocab import (draft_vocab, frequent_tokens, head_logits, restrict_logits, set_draft_vocab,
                                         to_token_ids)
from midlayer.engine.pretrained import load_pretrained, pretrained_config
from midlayer.model.gating import mirror_index
from midlayer.model.transformer import Transformer
from midlayer.ops.kernels import cpu_info
from midlayer.output_lock import OutputLock
from .distill import batches as make_batches, DistillSet
from .drafting import base_states, FrozenBase, kl_to_base, lower_states, model_device
from .eagle import eagle_forward, eagle_loss, EagleHead, feature_logits, FEATURE_NOISE
from .early_exit import early_exit_loss, EarlyExitHead
from .hidden_transfer import hidden_transfer_loss, HiddenTransfer, transfer_forward
from .medusa import medusa_loss, MedusaHeads
from .registry import check_base, load_draft, save_draft
from .skip_gates import gate_loss, SkipGates

METHODS = ("hidden-transfer", "medusa", "early-exit", "eagle", "gates")


def paper_layers(n_layers: int, k: int = 3) -> list[int]:
    """Transfer layers at the relative depths of the paper's layer study: steps 1 and 2 at blocks 15 and 20 of
    32 (sec. 4.4, Figs. 5-6, the 7B models), later steps at step 2's block -- our choice: the study names two,
    and the main experiments (sec. 4.1, 40-block 13B models) transfer at blocks 25, 30 and 35, spaced 5
    apart. SmolLM2 (30 blocks): 14, 19, 19."""
    t1, t2 = round(n_layers * 15 / 32), round(n_layers * 20 / 32)
    return [t1] + [t2] * (k - 1) if k > 1 else [t1]


@dataclass
class DraftTrainConfig:
    method: str = "hidden-transfer"  # hidden-transfer | medusa | early-exit | eagle
    model: str = "smollm2-135m"  # the frozen base: a short name, a Hugging Face folder or a .gguf file
    data: str = "runs/distill/smollm2-135m.jsonl"  # a `midlayer.speculative.distill` file made with this base
    out_dir: str = "runs/draft/hidden-transfer"
    k: int = 3  # draft depth: transfer steps / Medusa heads (paper: 3) / EAGLE depths scored on held-out
    layers: tuple[int, ...] = ()  # hidden transfer t_1..t_k; () = paper_layers(n_layers, k)
    exit_layer: int = -1  # early exit: the block whose input residual is decoded; -1 = t_1 of paper_layers
    masked: bool = False  # hidden transfer: the sec. 4.5 "masked" ablation (pseudo rows hide earlier steps)
    schedule: str = "joint"  # hidden transfer: joint | sequential (the paper: one step after another)
    epochs: float = 1.0  # passes over the training split (fractions allowed)
    lr: float = 1e-3
    batch_tokens: int = 1024  # tokens per batch (B * T)
    seq_len: int = 256  # sequences cut to this many tokens
    bf16: bool = True  # bf16 autocast for the frozen base's matmuls, where bf16 is native (GPUs, AMX /
    #                    AVX512-BF16 CPUs; ignored elsewhere, where it is emulated and slow); the KL is fp32
    seed: int = 0
    ckpt_every: int = 20
    max_eval_batches: int = 0  # held-out records to evaluate (one per batch); 0: all
    eval_every: int = 0  # steps between held-out loss evaluations (the learning curve); 0: only at the end
    patience: int = 0  # stop after this many evaluations without a new best held-out loss (0: never);
    #                    the best evaluated weights are the ones saved
    curve_batches: int = 64  # held-out records per curve evaluation (a fixed subset; 0: all)
    cache_gb: float = 4.0  # memory for frozen base states reused across epochs; beyond it, recomputed
    cache_dir: str = ""  # also keep the frozen states on disk here (content-addressed, any size; survives
    #                      the process, so later epochs in a later session skip the base forward); "": off
    loss_positions: str = "response"  # "response": only positions whose next token is a response token count
    #                                   (what a drafter guesses from at decode time); "all": every real token
    draft_vocab: int = 16384  # drafts score only the N most frequent training-response tokens (draft_vocab.py;
    #                           FR-Spec / EAGLE-3); 0: the full vocabulary (gates: always the full vocabulary)
    # method "gates" (skip_gates.py): routers (+ adapters) on the frozen base, KL + the sparsity controller
    gate_target: float = 0.5  # mean-gate target of the innermost gated block (mu_final; 1 at block 0, linear)
    gate_gamma: float = 1e-2  # controller step (eq. 6); 1e-2, not the paper's 1e-3: docs/results/controller-cpu.md
    gate_kp: float = 0.0  # controller proportional gain (SparsityConfig.kp)
    gate_beta_max: float = 0.0  # bound on the controller's variance coefficient (SparsityConfig.beta_max; 0: none)
    lora_rank: int = 0  # rank of the adapters on each block's wo and w2; 0: routers alone
    gate_values: str = "soft"  # "soft": eq. 2's gates; "hard": rounded to 0 or 1, all sparsity is real skipping;
    #                            "sampled": hard with a random threshold in training (ModelConfig.gate_values)
    router_norm: bool = False  # routers read h / ||h||_1 per token, not h (skip_gates.py, "Router scale")

    def __post_init__(self) -> None:
        check_finite(self)  # --lr inf, --epochs nan, ...
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if 0 < self.draft_vocab < 4:  # the held-out metrics score 4 ranks
            raise ValueError(f"draft_vocab must be 0 (the full vocabulary) or >= 4, got {self.draft_vocab}")
        if self.loss_positions not in ("response", "all"):
            raise ValueError(f"loss_positions must be 'response' or 'all', got {self.loss_positions!r}")
        if self.schedule not in ("joint", "sequential"):
            raise ValueError(f"schedule must be 'joint' or 'sequential', got {self.schedule!r}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.epochs <= 0 or self.lr <= 0 or self.batch_tokens < 2 or self.seq_len < 2:
            raise ValueError("epochs and lr must be > 0, batch_tokens and seq_len >= 2")
        if self.eval_every < 0 or self.patience < 0 or self.curve_batches < 0 or self.cache_gb < 0 or self.draft_vocab < 0:
            raise ValueError("eval_every, patience, curve_batches, cache_gb and draft_vocab must be >= 0")
        if self.ckpt_every < 1 or self.max_eval_batches < 0:  # (ckpt_every 0 divided by zero after a step)
            raise ValueError(f"ckpt_every must be >= 1 and max_eval_batches >= 0 (0: all), got {self.ckpt_every} and "
                             f"{self.max_eval_batches}")
        if self.exit_layer < -1:  # (every negative one read as -1's block)
            raise ValueError(f"exit_layer must be a block index, or -1 for the paper's t_1, got {self.exit_layer}")
        if self.patience and not self.eval_every:
            raise ValueError("patience needs eval_every > 0 (early stopping compares held-out evaluations)")
        if self.patience and self.method == "hidden-transfer" and self.schedule == "sequential":
            raise ValueError("patience: an early stop ends the run, so with schedule sequential it left the later "
                             "transfer maps untrained; train the sequential schedule for its planned steps")
        if self.method == "gates" and self.patience:
            raise ValueError("patience: early stopping on the held-out KL would keep the densest gates seen (the KL "
                             "is lowest at the dense start); gates train for their planned steps")
        if self.gate_values not in GATE_VALUES:
            raise ValueError(f"gate_values must be one of {', '.join(GATE_VALUES)}, got {self.gate_values!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}")
        if (not 0 <= self.gate_target <= 1 or self.gate_gamma < 0 or self.gate_kp < 0
                or self.gate_beta_max < 0):
            raise ValueError(f"gate_target must be in [0, 1] (a mean gate), gate_gamma, gate_kp and gate_beta_max "
                             f">= 0; got {self.gate_target}, {self.gate_gamma}, {self.gate_kp}, {self.gate_beta_max}")
        if self.cache_dir and Path(self.cache_dir).exists() and not Path(self.cache_dir).is_dir():
            raise ValueError(f"cache_dir {self.cache_dir}: exists and is not a directory")
        self.layers = tuple(int(t) for t in self.layers)


# settings that only some methods read; given to a run of none of them, they were dropped in silence
_GATES = ("gate_target", "gate_gamma", "gate_kp", "gate_beta_max", "lora_rank", "gate_values", "router_norm")
ONLY_FOR: dict[str, tuple[str, ...]] = {
    "layers": ("hidden-transfer",), "masked": ("hidden-transfer",), "schedule": ("hidden-transfer",),
    "exit_layer": ("early-exit",), "k": ("hidden-transfer", "medusa", "eagle"),
    "draft_vocab": ("hidden-transfer", "medusa", "early-exit", "eagle"), **{g: ("gates",) for g in _GATES}}


def check_used(given: dict[str, Any], methods: Sequence[str]) -> None:
    """Refuse a setting given (a flag, or a config file's) that no method of the run reads, naming it."""
    for name in given:
        users = ONLY_FOR.get(name)
        if users is not None and not set(users) & set(methods):
            raise ValueError(f"--{name.replace('_', '-')} is a setting of {' and '.join(users)}; this run trains "
                             f"{', '.join(methods)}, which would ignore it")


def check_blocks(cfgs: list[DraftTrainConfig], n_layers: int) -> None:
    """Refuse block indices a base of `n_layers` blocks does not have, naming the flag (they failed in the first
    step, after the base and the data had loaded, as "blocks 0..100 outside 0..30")."""
    for c in cfgs:
        if c.method == "hidden-transfer" and any(t > n_layers for t in c.layers):
            raise ValueError(f"--layers {','.join(map(str, c.layers))}: the base has {n_layers} blocks "
                             f"(0..{n_layers - 1})")
        if c.method == "early-exit" and c.exit_layer > n_layers:
            raise ValueError(f"--exit-layer {c.exit_layer}: the base has {n_layers} blocks (1..{n_layers})")


def build_module(cfg: DraftTrainConfig, model: Transformer) -> nn.Module:
    L = model.cfg.n_layers
    if cfg.method == "hidden-transfer":
        layers = list(cfg.layers) or paper_layers(L, cfg.k)
        return HiddenTransfer(model.cfg.dim, layers, cfg.k, masked=cfg.masked)
    if cfg.method == "medusa":
        return MedusaHeads(model.cfg.dim, cfg.k)
    if cfg.method == "eagle":
        return EagleHead.for_model(model)
    if cfg.method == "gates":
        return SkipGates.for_model(model, lora_rank=cfg.lora_rank, mu_final=cfg.gate_target, gamma=cfg.gate_gamma,
                                   kp=cfg.gate_kp, gate_values=cfg.gate_values,
                                   router_norm=cfg.router_norm, beta_max=cfg.gate_beta_max)
    layer = cfg.exit_layer if cfg.exit_layer >= 0 else paper_layers(L, 1)[0]
    if not 0 < layer <= L:
        raise ValueError(f"exit_layer must be in [1, {L}], got {layer}")
    return EarlyExitHead(model.cfg.dim, layer)


class FrozenStates:
    """Residuals of the frozen base for a batch, computed once and shared: by every drafter trained in the
    same loop (`train_drafts`: one base forward per batch serves them all) and by later epochs (the base
    never changes).

    `layers`: the blocks whose entering residual is kept (L = n_layers is the final residual): the final
    one for Medusa / EAGLE / the teacher, the exit block for early exit, t_1 for hidden transfer; the blocks
    up to the deepest one run (`drafters.lower_states`). States are kept in fp16 when they fit its range
    (half the memory; fp16 rounds to 2^-11 relative: the loss moves by < 1e-4 relative for every method,
    hidden transfer included, whose t_1 residual then runs through the upper blocks --
    tests/test_draft_training.py), else fp32; `cache_gb` bounds the memory, batches past it are recomputed (same values, only the cost differs).
    Gated bases: nothing is cached (their routers need the lower blocks) and each loss runs its own forward.
    """

    def __init__(self, model: Transformer, layers: set[int], cache_gb: float, cache_dir: str | Path = "") -> None:
        self.model, self.layers = model, sorted(layers)
        self.enabled = model.routers is None
        self.store: dict[Any, dict[int, torch.Tensor]] = {}
        self.budget, self.used = int(cache_gb * 2**30), 0  # bytes
        self.disk: Path | None = None
        if cache_dir and self.enabled:
            # Content-addressed: one folder per base (its weights' digest), one file per batch named by the
            # digest of its tokens and of how the states are computed (layers, autocast). A changed base,
            # data set or batching never reads a stale entry; nothing needs invalidating by hand.
            self.disk = Path(cache_dir) / _weights_digest(model)
            self.disk.mkdir(parents=True, exist_ok=True)
        self.disk_hits = 0

    def states(self, key: Any, tokens: torch.Tensor) -> dict[int, torch.Tensor] | None:
        """{layer: residual [B, T, d]} of `tokens` (fp32), from the store when `key` was seen."""
        if not self.enabled:
            return None
        got = self.store.get(key)
        if got is None:
            path = self._disk_path(tokens)
            packed = self._read(path) if path is not None else None
            if packed is None:
                with torch.no_grad():
                    got = lower_states(self.model, tokens, self.layers)
                packed = {k: _pack(v) for k, v in got.items()}
                if path is not None:
                    self._write(path, packed)
            else:
                self.disk_hits += 1
            size = sum(v.numel() * v.element_size() for v in packed.values())
            if self.used + size <= self.budget:
                self.store[key] = packed
                self.used += size
            got = packed  # stored or not, the same values: a resumed or uncached run sees what a cached one did
        return {k: v.float() for k, v in got.items()}

    def _disk_path(self, tokens: torch.Tensor) -> Path | None:
        if self.disk is None:
            return None
        h = hashlib.sha256(tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
        # and how the states are computed: layers, autocast, device type (CPU and CUDA kernels round
        # differently) and the torch version (kernels change between releases)
        h.update(repr((tuple(tokens.shape), self.layers, _autocast_tag(tokens.device.type), tokens.device.type,
                       torch.__version__)).encode())
        return self.disk / f"{h.hexdigest()[:32]}.pt"

    def _read(self, path: Path) -> dict[int, torch.Tensor] | None:
        """The stored states, or None when absent or unreadable (a torn or corrupt file is recomputed and
        rewritten, never trusted)."""
        if not path.exists():
            return None
        try:
            got = torch.load(path, map_location=model_device(self.model), weights_only=True)
            if sorted(got) != self.layers:
                raise ValueError(f"layers {sorted(got)}, expected {self.layers}")
            return got
        except Exception as e:  # noqa: BLE001 -- any failure means "not cached"
            warnings.warn(f"frozen-state cache {path}: unreadable ({e}); recomputing it")
            return None

    def _write(self, path: Path, packed: dict[int, torch.Tensor]) -> None:
        cpu = {k: v.cpu() for k, v in packed.items()}
        atomic_write(path, writer=lambda tmp: torch.save(cpu, tmp))  # a killed run leaves no torn entry


def _weights_digest(model: nn.Module) -> str:
    """Digest of a model's parameters and buffers (names, shapes, dtypes, bytes): the disk cache's folder."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def _autocast_tag(device_type: str) -> str:
    """How the states are computed: autocast on or off, and in which dtype (bf16 states differ from fp32)."""
    if torch.is_autocast_enabled(device_type):
        return f"autocast-{torch.get_autocast_dtype(device_type)}"
    return "fp32"


def _pack(x: torch.Tensor) -> torch.Tensor:
    """fp16 when every value is inside its range with margin, else the tensor as it is (FrozenStates)."""
    if x.dtype == torch.float32 and bool(x.abs().max() < 30000.0):
        return x.half()
    return x


def needed_layers(cfg: DraftTrainConfig, model: Transformer, module: nn.Module) -> set[int]:
    """The base residuals a method's loss reads (FrozenStates)."""
    L = model.cfg.n_layers
    if cfg.method == "hidden-transfer":
        return {min(module.layers)}
    if cfg.method == "early-exit":
        return {L, module.layer}
    return {L}


def loss_inputs(cfg: DraftTrainConfig, model: Transformer, module: nn.Module,
                states: dict[int, torch.Tensor] | None, memo: dict[Any, torch.Tensor]) -> Any:
    """What `_loss` takes as `cached` from the shared states: (t_1, residual) for hidden transfer; (teacher
    logits over the module's draft vocabulary, residuals by layer) for the others. `memo` shares the
    teacher logits between modules with the same draft vocabulary within one batch."""
    if states is None:
        return None
    if cfg.method == "hidden-transfer":
        t1 = min(module.layers)
        return t1, states[t1]
    L = model.cfg.n_layers
    vocab = draft_vocab(module)
    key = None if vocab is None else (vocab.numel(), int(vocab.sum()), int(vocab[-1]))
    logits = memo.get(key)
    if logits is None:
        with torch.no_grad():  # the teacher
            logits = memo[key] = head_logits(module, model, model.norm(states[L]))
    hs = [states.get(layer) for layer in range(L + 1)]
    return logits, hs


def _loss(cfg: DraftTrainConfig, model: Transformer, module: nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
          phase: int, cached: Any = None, step: int = 0, noise: bool = True) -> tuple[torch.Tensor, list[float]]:
    if cfg.method == "hidden-transfer":
        if phase:  # sequential: step `phase` alone, later steps' rows not even built
            return hidden_transfer_loss(model, module, tokens, n_steps=phase, only_step=phase, mask=mask,
                                        start=cached)
        return hidden_transfer_loss(model, module, tokens, mask=mask, start=cached)
    if cfg.method == "medusa":
        return medusa_loss(model, module, tokens, cached, mask=mask)
    # EAGLE's feature noise and sampled gates' thresholds are a pure function of (seed, step): a resumed run
    # draws what the uninterrupted one did
    gen = torch.Generator(device=tokens.device).manual_seed(cfg.seed * 1_000_003 + step)
    if cfg.method == "eagle":
        return eagle_loss(model, module, tokens, cached, mask=mask, noise=FEATURE_NOISE if noise else 0.0,
                          generator=gen)
    if cfg.method == "gates":
        teacher = cached[0] if cached is not None else base_states(model, tokens)[0]
        return gate_loss(model, module, tokens, teacher, mask, generator=gen)
    return early_exit_loss(model, module, tokens, cached, mask=mask)


def _phases(cfg: DraftTrainConfig, total: int) -> list[tuple[int, int]]:
    """(phase, steps): phase 0 = all parameters; sequential hidden transfer: phase i trains W_i only (fewer
    steps than k left the last maps at their initial identity, saved as trained: refused)."""
    if cfg.method == "hidden-transfer" and cfg.schedule == "sequential":
        if total < cfg.k:
            raise ValueError(f"schedule sequential: {total} training steps for k={cfg.k} transfer maps, one after "
                             "another; give each at least one (more --epochs or data, a smaller --batch-tokens)")
        return [(i, total // cfg.k + (1 if i - 1 < total % cfg.k else 0)) for i in range(1, cfg.k + 1)]
    return [(0, total)]


def _trainable(cfg: DraftTrainConfig, module: nn.Module, phase: int) -> list[nn.Parameter]:
    if phase:
        return [module.maps[phase - 1].weight]
    return list(module.parameters())


# ================================================================================================ eval
def response_batches(ds: Any, seq_len: int, limit: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out records one per batch, masked so that only drafts of *response* tokens count: position t is
    valid iff the token the base predicts there (index t + 1) is a response token or the one after the
    response. Prompt positions -- SmolLM2's chat template repeats a fixed system prompt -- are far easier
    to predict and are never drafted at decode time, so they would inflate the accuracies."""
    out = []
    for seq, P in zip(ds.sequences("heldout"), ds.prompt_lens("heldout")):
        seq = seq[:seq_len]
        if len(seq) <= P:
            continue
        t = torch.arange(len(seq))
        out.append((torch.tensor([seq]), (t >= P - 1)[None]))
        if limit and len(out) == limit:
            break
    return out


def evaluate_draft(path: str | Path, model: Transformer | None = None, data: Any = None) -> dict[str, Any]:
    """Recompute a saved draft's held-out metrics (e.g. after a change of the metric); rewrites
    metrics.json and the draft's meta. Returns the metrics."""

    out = Path(path)
    meta = json.loads((out / "draft.json").read_text())["meta"]
    # drafts trained before these settings existed used the full vocabulary and every position
    cfg = DraftTrainConfig(**{"draft_vocab": 0, "loss_positions": "all", **meta["train"]})
    if model is None:
        model = load_pretrained(cfg.model)[0].eval()
    module, _ = load_draft(out, model)
    ds = data if data is not None else DistillSet.load(cfg.data)
    held = response_batches(ds, cfg.seq_len, cfg.max_eval_batches)
    with _autocast(cfg, model):
        metrics = heldout_metrics(cfg, model, module, held)
    old = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").is_file() else {}
    for key in ("steps", "planned_steps", "curve", "best_step", "lowest_loss_step", "train_seconds_this_call",
                "train_batches", "final_loss", "settings", "data_header", "draft_vocab_size"):
        if key in old:
            metrics[key] = old[key]
    metrics["heldout_batches"] = len(held)
    _save(cfg, out, model, module, metrics)
    return metrics


def bf16_native(model: Transformer) -> bool:
    """bf16 autocast pays off on GPUs and on CPUs with AVX512-BF16 / AMX; elsewhere bf16 matmuls are emulated
    and slower than fp32 (docs/results/decode-cpu.md: 8.1 s vs 1.3 s for a 693-token prefill on Zen 2)."""

    dev = model_device(model)
    return dev.type == "cuda" or (dev.type == "cpu" and cpu_info().native_bf16)


def _autocast(cfg: DraftTrainConfig, model: Transformer) -> torch.autocast:
    return torch.autocast(model_device(model).type, dtype=torch.bfloat16, enabled=cfg.bf16 and bf16_native(model))


@torch.no_grad()
def heldout_loss(cfg: DraftTrainConfig, model: Transformer, module: nn.Module,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], frozen: FrozenStates | None = None) -> float:
    """The training loss on held-out records (response positions only, `response_batches`), weighted by
    their valid positions: the learning curve and the early-stopping criterion. `frozen`: the base's states
    of these records are computed once and shared by every evaluation and drafter (key ("held", i))."""
    was = module.training
    module.eval()
    total = weight = 0.0
    dev = model_device(model)
    for i, (tokens, mask) in enumerate(batches):
        tokens, mask = tokens.to(dev), mask.to(dev)
        states = None if frozen is None else frozen.states(("held", i), tokens)
        cached = loss_inputs(cfg, model, module, states, {})
        loss, per = _loss(cfg, model, module, tokens, mask, 0, cached, 0, noise=False)
        w = float(mask.sum())
        total += (per[0] if cfg.method == "gates" else float(loss)) * w  # gates: the KL (the controller's term
        #                                                                    measures no quality)
        weight += w
    module.train(was)
    return total / max(weight, 1.0)


def _save(cfg: DraftTrainConfig, out: Path, model: Transformer, module: nn.Module, metrics: dict[str, Any]) -> None:
    """The draft (weights + JSON with the training settings and held-out metrics) and metrics.json."""
    save_draft(out, module, {"train": dataclasses.asdict(cfg), "heldout": metrics}, base=model,
               base_name=cfg.model if not Path(cfg.model).exists() else None)
    atomic_write(out / "metrics.json", json.dumps(json_safe(metrics), indent=2).encode("utf-8"))  # NaN -> null


@torch.no_grad()
def heldout_metrics(cfg: DraftTrainConfig, model: Transformer, module: nn.Module,
                    batches: list[tuple[torch.Tensor, torch.Tensor]], ranks: int = 4) -> dict[str, Any]:
    """acc[d][r] (per-rank accuracy at depth d + 1), top1, the anchors counted per depth, and for hidden
    transfer the cosine similarity of pseudo vs real states by block (module docstring)."""
    dev = model_device(model)
    vocab = draft_vocab(module)  # candidates are draft-vocabulary tokens; targets the base's full argmax
    hits: list[torch.Tensor] = []
    counts: list[float] = []
    L = model.cfg.n_layers
    cos_sum: dict[tuple[int, int], float] = {}
    cos_n: dict[tuple[int, int], float] = {}
    gated = _GateTally(L)
    with FrozenBase(model):
        for tokens, mask in batches:
            tokens, mask = tokens.to(dev), mask.to(dev)
            T = tokens.shape[1]
            pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (draft logits, target, valid)
            if cfg.method == "hidden-transfer":
                states: dict[int, torch.Tensor] = {}
                real, pseudo = transfer_forward(model, module, tokens, collect=states, full=True)
                for i, p in enumerate(pseudo, start=1):
                    pairs.append((restrict_logits(p, vocab), real[:, i:].argmax(-1), mask[:, i:]))
                    # Fig. 4: the step-i pseudo row of anchor j vs the real row at j + i, entering each block.
                    anchor, step = states["anchor"], states["step"]
                    rows = (step == i).nonzero().flatten()
                    tgt = anchor[rows] + i
                    for layer in range(module.layers[i - 1], L + 1):
                        x = states[layer]
                        c = torch.cosine_similarity(x[:, rows].float(), x[:, tgt].float(), dim=-1)
                        w = mask[:, i:].float()
                        cos_sum[(i, layer)] = cos_sum.get((i, layer), 0.0) + float((c * w).sum())
                        cos_n[(i, layer)] = cos_n.get((i, layer), 0.0) + float(w.sum())
            else:
                logits, hs = base_states(model, tokens)
                target = logits.argmax(-1)
                if cfg.method == "medusa":
                    for i in range(module.k):
                        A = T - 1 - i
                        if A > 0:
                            pairs.append((module.logits(model, hs[-1][:, :A], i), target[:, 1 + i:], mask[:, 1 + i:]))
                elif cfg.method == "gates":
                    out = module.twin(model)(tokens)
                    pairs.append((out.logits, target, mask))
                    gated.add(out, logits, mask)
                elif cfg.method == "eagle":
                    if T >= 2:  # depth i: anchors 0..T-1-i, target the base argmax at a + i
                        preds = eagle_forward(model, module, tokens, hs[-1], min(cfg.k, T - 1))
                        for i, fhat in enumerate(preds, start=1):
                            pairs.append((feature_logits(model, fhat, module), target[:, i:], mask[:, i:]))
                else:
                    pairs.append((module.logits(model, hs[module.layer]), target, mask))
            for d, (lg, tgt, valid) in enumerate(pairs):
                top = to_token_ids(lg.float().topk(ranks, -1).indices, vocab)  # [B, A, ranks] token ids
                h = ((top == tgt[..., None]) & valid[..., None]).sum((0, 1)).float().cpu()
                if d >= len(hits):
                    hits.append(torch.zeros(ranks))
                    counts.append(0.0)
                hits[d] += h
                counts[d] += float(valid.sum())
    acc = [[round(float(x) / max(c, 1.0), 4) for x in h] for h, c in zip(hits, counts)]
    out: dict[str, Any] = {"acc": acc, "top1": [a[0] for a in acc], "anchors": counts}
    out.update(gated.metrics())
    if cos_sum:
        steps = sorted({i for i, _ in cos_sum})
        out["cosine"] = {str(i): {str(layer): round(cos_sum[(i, layer)] / max(cos_n[(i, layer)], 1.0), 4)
                                  for (j, layer) in sorted(cos_sum) if j == i} for i in steps}
    return out


class _GateTally:
    """Held-out quality and sparsity of skip gates over the counted positions: the KL to the dense model,
    per-block mean gate and fraction of gates exactly 0 (tokens that skip the block: real compute saved),
    and the mean fraction of the L blocks a token skips."""

    def __init__(self, n_layers: int) -> None:
        self.L, self.kl, self.n = n_layers, 0.0, 0.0
        self.gate_sum = torch.zeros(n_layers // 2)
        self.zero_sum = torch.zeros(n_layers // 2)

    def add(self, out: Any, dense_logits: torch.Tensor, mask: torch.Tensor) -> None:
        w = float(mask.sum())
        if not w:
            return
        self.kl += float(kl_to_base(dense_logits[mask], out.logits[mask])) * w
        g = out.gates[:, mask].float().cpu()  # [L/2, n]
        self.gate_sum += g.sum(1)
        self.zero_sum += (g == 0).float().sum(1)
        self.n += w

    def metrics(self) -> dict[str, Any]:
        if not self.n:
            return {}
        half = [round(float(x) / self.n, 4) for x in self.gate_sum]
        zero = [round(float(x) / self.n, 4) for x in self.zero_sum]
        mirror = [mirror_index(layer, self.L) for layer in range(self.L)]
        return {"kl": round(self.kl / self.n, 6), "gate_mean": [half[i] for i in mirror],
                "gate_zero": [zero[i] for i in mirror],
                "skipped_blocks_frac": round(sum(zero[i] for i in mirror) / self.L, 4)}


# =============================================================================================== train
@dataclass
class DraftRun:
    module: nn.Module
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None


def _state_path(out: Path) -> Path:
    return out / "train_state.pt"


# Settings every drafter of one `train_drafts` loop must share: they fix the batches, their order and the
# number of steps (the equal-data, equal-budget comparison), or what the shared frozen states are.
SHARED = ("model", "data", "epochs", "batch_tokens", "seq_len", "bf16", "seed", "ckpt_every", "max_eval_batches",
          "eval_every", "patience", "curve_batches", "cache_gb", "cache_dir", "draft_vocab", "loss_positions")


# Settings that change only the cost or the place, never a value: a resume may change them (a run folder
# may be moved, e.g. one trained on a GPU machine and copied into the repository).
COST_ONLY = ("cache_gb", "cache_dir", "out_dir")


# Settings added after runs were saved, with the value that reproduces what those runs did: a saved state
# without one of them was made with this value (the gates settings only act for method "gates").
ADDED_LATER = {"cache_dir": "", "gate_target": 0.5, "gate_gamma": 1e-2, "gate_kp": 0.0, "lora_rank": 0,
               "gate_values": "soft", "router_norm": False, "gate_beta_max": 0.0}


def _saved_settings(old: dict[str, Any]) -> dict[str, Any]:
    """A saved state's settings, completed with the settings added since (ADDED_LATER)."""
    return {**ADDED_LATER, **old}


def _same_run(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """The saved settings (completed by `_saved_settings`) and these give the same training (cost-only
    settings aside)."""
    return {k: v for k, v in old.items() if k not in COST_ONLY} == {k: v for k, v in new.items() if k not in COST_ONLY}


def _extends(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """True when `new` only trains longer than `old`: more epochs, the same everything else, and one phase
    (the sequential schedule's phase lengths depend on the total). The batch of a step is a function of the
    seed and the step alone, so the longer run's first steps are the shorter run's. `old`: completed by
    `_saved_settings`."""
    rest = [k for k in set(old) | set(new) if k not in ("epochs", *COST_ONLY) and old.get(k) != new.get(k)]
    one_phase = not (new.get("method") == "hidden-transfer" and new.get("schedule") == "sequential")
    return not rest and one_phase and float(new.get("epochs", 0)) >= float(old.get("epochs", math.inf))


class _Run:
    """One drafter's training state inside the shared loop: module, optimiser, step, learning curve, early
    stopping, and its resumable state file `out_dir/train_state.pt`."""

    def __init__(self, cfg: DraftTrainConfig, model: Transformer, total: int, data_fp: str, vocab: torch.Tensor | None,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.model, self.total, self.log = cfg, model, total, log
        self.phases = _phases(cfg, total)  # (refused before anything is written)
        torch.manual_seed(cfg.seed)  # the same initial weights as when trained alone
        self.module = build_module(cfg, model).to(model_device(model))
        if vocab is not None and cfg.method != "gates":  # gates are the base's own head: the full vocabulary
            set_draft_vocab(self.module, vocab)
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.sp = _state_path(self.out)
        self.settings, self.data_fp = dataclasses.asdict(cfg), data_fp
        self.step, self.history, self.opt_state = 0, [], None
        self.curve: list[dict[str, Any]] = []
        self.best: dict[str, Any] = {"loss": math.inf, "step": 0, "module": None}
        self.stale, self.done_here = 0, 0
        self.opt: torch.optim.Optimizer | None = None
        self.phase = -1
        if self.sp.is_file():
            try:
                st = torch.load(self.sp, map_location="cpu", weights_only=True)  # plain dicts, lists, tensors
            except Exception as e:  # truncated, random bytes, another file's: one line, not torch's paragraphs
                why = (str(e).strip().splitlines() or [""])[0][:200]
                raise ValueError(f"{self.sp}: the training state is damaged or not a torch file ({type(e).__name__}: "
                                 f"{why}); delete it to start the run over") from None
            if not isinstance(st, dict) or not {"module", "step", "history", "opt"} <= set(st):
                raise ValueError(f"{self.sp}: not a train-draft training state; delete it to start the run over")
            old = _saved_settings(st.get("settings") or {})
            if not _same_run(old, self.settings):
                if not _extends(old, self.settings):
                    changed = sorted(k for k in set(old) | set(self.settings)
                                     if k not in COST_ONLY and old.get(k) != self.settings.get(k))
                    raise ValueError(f"{self.sp}: made with other settings ({', '.join(changed)}); use another "
                                     "--out-dir or delete it to start over (only --epochs may grow)")
                log(f"{cfg.method}: extending the run from epochs={old['epochs']} to {cfg.epochs}")
            if st.get("data", data_fp) != data_fp:
                raise ValueError(f"{self.sp}: made on other data ({cfg.data} changed since: records added or edited); "
                                 "continuing would train on other batches. Use another --out-dir or delete it")
            self.module.load_state_dict(st["module"])
            self.step, self.history, self.opt_state = st["step"], st["history"], st["opt"]
            self.curve, self.best, self.stale = st.get("curve", []), st.get("best", self.best), st.get("stale", 0)
            log(f"resuming {cfg.method} at step {self.step}/{total}")
        self.stopped = bool(cfg.patience) and self.stale >= cfg.patience  # early stop; True: already stopped

    def save_state(self, phase_done: bool = False) -> None:
        """The resumable state, atomically (a finished phase saves no optimiser moments to resume with)."""
        state = {"settings": self.settings, "module": self.module.state_dict(), "step": self.step,
                 "history": self.history, "opt": {"phase": -1 if phase_done or self.opt is None else self.phase,
                                                  "state": {} if self.opt is None else self.opt.state_dict()},
                 "curve": self.curve, "best": self.best, "stale": self.stale, "data": self.data_fp}
        atomic_write(self.sp, writer=lambda tmp: torch.save(state, tmp))

    @property
    def active(self) -> bool:
        return self.step < self.total and not self.stopped

    def _phase_at(self, step: int) -> tuple[int, int]:
        """(phase, last step of the phase + 1) of `step` (module `_phases`)."""
        first = 0
        for phase, n in self.phases:
            if step < first + n:
                return phase, first + n
            first += n
        return self.phases[-1][0], first

    def _optimiser(self) -> None:
        """The phase's Adam on its parameters (the others frozen), with the saved moments when resuming."""
        phase, _ = self._phase_at(self.step)
        if phase == self.phase and self.opt is not None:
            return
        params = _trainable(self.cfg, self.module, phase)
        for p in self.module.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        self.params, self.phase = params, phase
        self.opt = torch.optim.Adam(params, lr=self.cfg.lr)
        if self.opt_state is not None and self.opt_state.get("phase") == phase:
            self.opt.load_state_dict(self.opt_state["state"])
        self.opt_state = None
        self.module.train()

    def train_step(self, tokens: torch.Tensor, mask: torch.Tensor, states: dict[int, torch.Tensor] | None,
                   memo: dict[Any, torch.Tensor], autocast: torch.autocast, curve_b: list, frozen: FrozenStates
                   ) -> float:
        """One optimiser step on the batch; evaluates, checkpoints and early-stops as configured."""
        cfg = self.cfg
        self._optimiser()
        with autocast:
            cached = loss_inputs(cfg, self.model, self.module, states, memo)
        with torch.enable_grad(), autocast:
            loss, per = _loss(cfg, self.model, self.module, tokens, mask, self.phase, cached, self.step)
        if not torch.isfinite(loss.detach()):  # nothing is saved from here on: the state stays good
            sp = self.sp
            saved = f"{sp} (step {torch.load(sp, weights_only=True)['step']})" if sp.is_file() else "none"
            raise ValueError(f"non-finite {cfg.method} draft loss at step {self.step + 1}; last saved state: "
                             f"{saved}. Resume with a lower --lr (in a new --out-dir: settings must match)")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        after = getattr(self.module, "after_step", None)
        if after is not None:  # SkipGates: the controller's eq. 6 update, after the optimiser step
            after()
        self.step += 1
        self.done_here += 1
        value = float(loss.detach())
        self.history.append({"step": self.step, "phase": self.phase, "loss": value, "per_step": per})
        evaluated = False
        if cfg.eval_every and self.step % cfg.eval_every == 0:
            with autocast:
                hl = heldout_loss(cfg, self.model, self.module, curve_b, frozen)
            recent = [h["loss"] for h in self.history[-cfg.eval_every:]]
            self.curve.append({"step": self.step, "heldout_loss": round(hl, 6),
                               "train_loss": round(sum(recent) / len(recent), 6)})
            if hl < self.best["loss"]:
                self.best = {"loss": hl, "step": self.step,
                             "module": {k: v.detach().clone().cpu() for k, v in self.module.state_dict().items()}}
                self.stale = 0
            else:
                self.stale += 1
            evaluated = True
            self.log(f"{cfg.method} step {self.step}: held-out loss {hl:.4f} "
                     f"(best {self.best['loss']:.4f} at step {self.best['step']})")
            self.stopped = bool(cfg.patience) and self.stale >= cfg.patience
        _, phase_end = self._phase_at(self.step - 1)
        last = self.step == phase_end or self.stopped
        if self.step % cfg.ckpt_every == 0 or last or evaluated:
            # a finished phase drops its optimiser moments, except the final one: --epochs may grow later
            self.save_state(last and self.step < self.total)
        if last:
            self.opt = None  # the next phase starts a fresh optimiser
        if self.stopped:
            self.log(f"{cfg.method}: early stop at step {self.step}: no better held-out loss in {cfg.patience} "
                     f"evaluations; keeping step {self.best['step']}")
        return value

    def finish(self, ds: Any, held_b: list, n_train: int, autocast: torch.autocast, train_s: float) -> DraftRun:
        """Best weights (with patience), held-out metrics, saved draft and history."""
        cfg, module = self.cfg, self.module
        if cfg.patience and self.best["module"] is not None:  # early stopping keeps the best evaluated weights
            module.load_state_dict(self.best["module"])
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        with autocast:
            metrics = heldout_metrics(cfg, self.model, module, held_b)
        metrics.update(steps=self.step, planned_steps=self.total, curve=self.curve,
                       # the saved weights' step (the best evaluated with patience, else the last); and the step of
                       # the lowest held-out loss (without patience best_step named it: weights never saved)
                       best_step=self.best["step"] if cfg.patience and self.best["module"] is not None else self.step,
                       lowest_loss_step=self.best["step"] if self.curve else None,
                       train_seconds_this_call=round(train_s, 1), train_batches=n_train,
                       heldout_batches=len(held_b), final_loss=self.history[-1]["loss"] if self.history else None,
                       settings=self.settings, draft_vocab_size=None if draft_vocab(module) is None
                       else int(draft_vocab(module).numel()),
                       data_header={k: ds.header.get(k) for k in ("model_name", "max_new_tokens")})
        _save(cfg, self.out, self.model, module, metrics)
        atomic_write(self.out / "history.jsonl",
                     "".join(json.dumps(json_safe(h)) + "\n" for h in self.history).encode("utf-8"))
        self.log(f"{cfg.method}: held-out top-1 per step {metrics['top1']}; saved to {self.out}")
        return DraftRun(module, metrics, self.history, self.out)


def train_draft(cfg: DraftTrainConfig, model: Transformer | None = None, data: Any = None, *,
                progress: bool = True, stop_after: int | None = None,
                log: Callable[[str], None] = print) -> DraftRun:
    """Train one drafter (`train_drafts` with one config)."""
    return train_drafts([cfg], model, data, progress=progress, stop_after=stop_after, log=log)[0]


def train_drafts(cfgs: list[DraftTrainConfig], model: Transformer | None = None, data: Any = None, *,
                 progress: bool = True, stop_after: int | None = None,
                 log: Callable[[str], None] = print, device: torch.device | str | None = None,
                 export_now: bool = False, overwrite: bool = False) -> list[DraftRun]:
    """Train drafters in lockstep on the same batches, evaluate each on held-out, save each to its out_dir
    (module docstring). Every step draws one batch, runs the frozen base once (`FrozenStates`, shared) and
    gives each drafter whose own step has reached it one optimiser step; a drafter resumed at a later step
    waits for the loop to catch up, so each one's continuation is the one it would have made alone.
    Each out_dir is locked for the call (output_lock.py: one writer per folder), and a folder that holds a
    finished draft but no training state to continue is refused unless `overwrite`.
    `model`/`data` (a DistillSet) may be given to skip loading; `stop_after` stops after that many loop
    steps in this call (a resumable state is saved). `device`: where a loaded base (and so the drafters)
    runs (default: the CPU); a given `model` stays where it is. A state saved on one device resumes on any
    other (the continuation then differs only by the devices' rounding)."""
    if not cfgs:
        raise ValueError("no drafter to train")
    c0 = cfgs[0]
    for c in cfgs[1:]:
        diff = [k for k in SHARED if getattr(c, k) != getattr(c0, k)]
        if diff:
            raise ValueError(f"drafters trained together must share {', '.join(diff)} ({c.method} vs {c0.method})")
    outs = [str(Path(c.out_dir).resolve()) for c in cfgs]
    if len(set(outs)) != len(outs):
        raise ValueError("drafters trained together need distinct out_dir")
    if model is None:  # the base's blocks from its metadata: a bad block index is refused before the base loads
        check_blocks(cfgs, pretrained_config(c0.model).n_layers)
    for c in cfgs:
        out = Path(c.out_dir)
        if (out / "draft.json").is_file() and not _state_path(out).is_file() and not overwrite and not export_now:
            raise ValueError(f"--out-dir {out} holds a finished draft (draft.json) and no training state to "
                             "continue; pass --overwrite to replace it, or choose another --out-dir")
    with ExitStack() as locks:
        for c in cfgs:
            locks.enter_context(OutputLock(c.out_dir, "train-draft"))
        return _train_drafts(cfgs, model, data, progress, stop_after, log, device, export_now)


def _train_drafts(cfgs: list[DraftTrainConfig], model: Transformer | None, data: Any, progress: bool,
                  stop_after: int | None, log: Callable[[str], None], device: torch.device | str | None,
                  export_now: bool) -> list[DraftRun]:

    c0 = cfgs[0]
    if model is None:
        model = load_pretrained(c0.model)[0].to(device or "cpu")
    model.eval()
    ds = data if data is not None else DistillSet.load(c0.data)
    if isinstance(ds.header.get("base"), dict):  # made by this base? (its greedy answers are the teacher's)

        check_base(ds.header["base"], model, None, f"--data {c0.data}: made by another base model;")
    ds.check_vocab(model.cfg.vocab_size)
    longest, ctx = max((len(x) for x in ds.sequences()), default=0), model.cfg.max_seq_len
    if min(longest, c0.seq_len) > ctx:  # (found before training: it failed in the last evaluation, or mid-run)
        raise ValueError(f"--seq-len {c0.seq_len}: {c0.data} holds records of up to {longest} tokens, and the base's "
                         f"context is {ctx}: pass --seq-len {ctx} or less")
    train_b = make_batches(ds.sequences("train"), c0.batch_tokens, c0.seq_len, c0.seed, pad_id=ds.pad_id,
                           prompt_lens=ds.prompt_lens("train") if c0.loss_positions == "response" else None)
    held_b = response_batches(ds, c0.seq_len, c0.max_eval_batches)
    if not train_b or not held_b:
        raise ValueError(f"{c0.data}: needs records in both the train and the heldout split")
    total = max(1, math.ceil(c0.epochs * len(train_b)))
    vocab = None
    if c0.draft_vocab:
        vocab = frequent_tokens((r.response_ids for r in ds.split("train")), c0.draft_vocab, model.cfg.vocab_size)
        if vocab.numel() < 4:  # (the held-out metrics score 4 ranks: it failed after the last step)
            raise ValueError(f"--draft-vocab {c0.draft_vocab}: {c0.data}'s train responses hold {vocab.numel()} "
                             "distinct tokens, fewer than the 4 ranks a draft is scored at; pass --draft-vocab 0 "
                             "(the whole vocabulary), or check the data (answers of end-of-turn tokens only?)")
    data_fp = ds.fingerprint()
    runs = [_Run(c, model, total, data_fp, vocab, log) for c in cfgs]
    autocast = _autocast(c0, model)
    if export_now:
        untrained = [str(r.sp) for r in runs if not r.sp.is_file()]
        if untrained:
            raise ValueError(f"nothing to export: no training state at {', '.join(untrained)} (train first)")
        return [r.finish(ds, held_b, len(train_b), autocast, 0.0) for r in runs]
    curve_b = held_b[:c0.curve_batches] if c0.curve_batches else held_b
    frozen = FrozenStates(model, set().union(*(needed_layers(r.cfg, model, r.module) for r in runs)), c0.cache_gb,
                          c0.cache_dir)
    t0 = time.time()
    step = min((r.step for r in runs if r.active), default=total)
    bar = None
    if progress:
        from tqdm import tqdm

        names = "+".join(c.method for c in cfgs)
        bar = tqdm(total=total, initial=step, desc=f"train-draft {names}", unit="step")
    done_here = 0
    dev = model_device(model)
    try:
        with FrozenBase(model):
            while any(r.active for r in runs):
                due = [r for r in runs if r.active and r.step == step]
                if due:
                    index = step % len(train_b)
                    tokens, mask = (t.to(dev) for t in train_b[index])
                    with autocast:
                        states = frozen.states(index, tokens)
                    memo: dict[Any, torch.Tensor] = {}
                    losses = {(r.cfg.method if len({q.cfg.method for q in runs}) == len(runs) else r.out.name):
                              r.train_step(tokens, mask, states, memo, autocast, curve_b, frozen) for r in due}
                    if bar is not None:
                        bar.set_postfix({k: f"{v:.3f}" for k, v in losses.items()})
                step += 1
                done_here += 1
                if bar is not None:
                    bar.update(1)
                if stop_after and done_here >= stop_after and any(r.active for r in runs):
                    for r in runs:  # a resumable state for each drafter trained in this call
                        if r.done_here:
                            r.save_state()
                    return [DraftRun(r.module, {}, r.history, r.out) for r in runs]
    finally:
        if bar is not None:
            bar.close()
    train_s = time.time() - t0
    return [r.finish(ds, held_b, len(train_b), autocast, train_s) for r in runs]


__all__ = ["DraftTrainConfig", "train_draft", "train_drafts", "heldout_metrics", "evaluate_draft", "response_batches", "paper_layers", "build_module", "METHODS"]

"""`midlayer train-draft`: train a drafter (hidden transfer, Medusa heads, an early-exit head or an EAGLE head) on
a frozen base model by self-distillation, evaluate it on the held-out prompts, save only the draft weights.

Data: a distillation file (`midlayer.distill`: the base model's own responses, greedy or sampled, to the
prompt set of `midlayer.prompts` or the scaled one of `midlayer.prompt_recipe`), split into train / held-out by prompt. Every method sees the same batches (same
sequences, order and number of optimiser steps): the baselines get the same data and budget.

Loss (Wu et al. 2024 sec. 3.3, and the same KL for the baselines): forward KL from the base model's own
next-token distribution at the position a draft stands for to the draft's distribution, over real
(non-padding) target positions. The base is frozen; Adam on the draft parameters only. EAGLE adds its
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
    (same values, only the cost differs), so 2M-token sets train in fixed memory;
  * bf16 autocast (`bf16`) is used only where bf16 is native (GPUs, AVX512-BF16 / AMX CPUs): emulated
    bf16 is slower than fp32.

Resume: every `ckpt_every` steps the draft weights, the Adam state and the step are saved atomically to
`out_dir/train_state.pt`; a rerun with the same settings continues from there (the batch sequence is a pure
function of the seed and the step, so the continuation is the one an uninterrupted run would have made).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .checkpoint import atomic_write_bytes
from .config import check_finite
from .drafters import (EarlyExitHead, FrozenBase, MedusaHeads, base_states, early_exit_loss, lower_states,
                       medusa_loss, model_device, save_draft)
from .eagle import FEATURE_NOISE, EagleHead, eagle_forward, eagle_loss, feature_logits
from .hidden_transfer import HiddenTransfer, hidden_transfer_loss, transfer_forward
from .model import Transformer
from .train import json_safe

METHODS = ("hidden-transfer", "medusa", "early-exit", "eagle")


def paper_layers(n_layers: int, k: int = 3) -> list[int]:
    """Transfer layers at the paper's relative depths: steps 1 and 2 at blocks 15 and 20 of 32 (sec. 4.4,
    Figs. 5-6), later steps at step 2's block (the paper names only two); SmolLM2 (30 blocks): 14, 19, 19."""
    t1, t2 = round(n_layers * 15 / 32), round(n_layers * 20 / 32)
    return [t1] + [t2] * (k - 1) if k > 1 else [t1]


@dataclass
class DraftTrainConfig:
    method: str = "hidden-transfer"  # hidden-transfer | medusa | early-exit | eagle
    model: str = "smollm2-135m"  # the frozen base: a short name, a Hugging Face folder or a .gguf file
    data: str = "runs/distill/smollm2-135m.jsonl"  # a `midlayer.distill` file made with this base
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

    def __post_init__(self) -> None:
        check_finite(self)  # --lr inf, --epochs nan, ...
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.schedule not in ("joint", "sequential"):
            raise ValueError(f"schedule must be 'joint' or 'sequential', got {self.schedule!r}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.epochs <= 0 or self.lr <= 0 or self.batch_tokens < 2 or self.seq_len < 2:
            raise ValueError("epochs and lr must be > 0, batch_tokens and seq_len >= 2")
        if self.eval_every < 0 or self.patience < 0 or self.curve_batches < 0 or self.cache_gb < 0:
            raise ValueError("eval_every, patience, curve_batches and cache_gb must be >= 0")
        if self.patience and not self.eval_every:
            raise ValueError("patience needs eval_every > 0 (early stopping compares held-out evaluations)")
        self.layers = tuple(int(t) for t in self.layers)


def build_module(cfg: DraftTrainConfig, model: Transformer) -> nn.Module:
    L = model.cfg.n_layers
    if cfg.method == "hidden-transfer":
        layers = list(cfg.layers) or paper_layers(L, cfg.k)
        return HiddenTransfer(model.cfg.dim, layers, cfg.k, masked=cfg.masked)
    if cfg.method == "medusa":
        return MedusaHeads(model.cfg.dim, cfg.k)
    if cfg.method == "eagle":
        return EagleHead.for_model(model)
    layer = cfg.exit_layer if cfg.exit_layer >= 0 else paper_layers(L, 1)[0]
    if not 0 < layer <= L:
        raise ValueError(f"exit_layer must be in [1, {L}], got {layer}")
    return EarlyExitHead(model.cfg.dim, layer)


class FrozenStates:
    """Per-batch states of the frozen base, computed once and reused every epoch (the base never changes).

    Hidden transfer (dense bases): the real rows' residual entering block t_1 -- the blocks below are not
    run again. Medusa / EAGLE / early exit: the final residual (the teacher logits are recomputed from it by
    the frozen norm + head, far cheaper than the forward; it is also EAGLE's feature and regression target)
    and the exit block's residual: after the first epoch their steps cost only the draft module. Gated
    bases: nothing is cached (their routers need the lower blocks). Kept in fp32 on the base's device:
    ~2.3 KB per token per cached state for SmolLM2."""

    def __init__(self, cfg: DraftTrainConfig, model: Transformer, module: nn.Module) -> None:
        self.cfg, self.model, self.module = cfg, model, module
        self.enabled = model.routers is None
        self.store: dict[int, Any] = {}
        self.budget, self.used = int(cfg.cache_gb * 2**30), 0  # bytes; batches past the budget are recomputed

    def get(self, index: int, tokens: torch.Tensor) -> Any:
        if not self.enabled:
            return None
        got = self.store.get(index)
        if got is None:
            model = self.model
            with torch.no_grad():
                if self.cfg.method == "hidden-transfer":
                    t1 = min(self.module.layers)
                    got = (t1, lower_states(model, tokens, t1))
                else:
                    hs = model(tokens, output_hidden_states=True, return_logits=False).hidden_states
                    keep = {model.cfg.n_layers: hs[-1]}
                    if self.cfg.method == "early-exit":
                        keep[self.module.layer] = hs[self.module.layer]
                    got = keep
            size = sum(t.numel() * t.element_size() for t in _tensors(got))
            if self.used + size <= self.budget:  # same values either way: only the cost differs
                self.store[index] = got
                self.used += size
        if self.cfg.method == "hidden-transfer":
            return got
        L = self.model.cfg.n_layers
        hs = [got.get(layer) for layer in range(L + 1)]
        with torch.no_grad():
            logits = self.model.output(self.model.norm(hs[L]))
        return logits, hs


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    return [t for v in x for t in _tensors(v)] if isinstance(x, (list, tuple)) else []


def _loss(cfg: DraftTrainConfig, model: Transformer, module: nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
          phase: int, cached: Any = None, step: int = 0, noise: bool = True) -> tuple[torch.Tensor, list[float]]:
    if cfg.method == "hidden-transfer":
        if phase:  # sequential: step `phase` alone, later steps' rows not even built
            return hidden_transfer_loss(model, module, tokens, n_steps=phase, only_step=phase, mask=mask,
                                        start=cached)
        return hidden_transfer_loss(model, module, tokens, mask=mask, start=cached)
    if cfg.method == "medusa":
        return medusa_loss(model, module, tokens, cached, mask=mask)
    if cfg.method == "eagle":
        # the noise is a pure function of (seed, step): a resumed run draws what the uninterrupted one did
        gen = torch.Generator(device=tokens.device).manual_seed(cfg.seed * 1_000_003 + step)
        return eagle_loss(model, module, tokens, cached, mask=mask, noise=FEATURE_NOISE if noise else 0.0,
                          generator=gen)
    return early_exit_loss(model, module, tokens, cached, mask=mask)


def _phases(cfg: DraftTrainConfig, total: int) -> list[tuple[int, int]]:
    """(phase, steps): phase 0 = all parameters; sequential hidden transfer: phase i trains W_i only."""
    if cfg.method == "hidden-transfer" and cfg.schedule == "sequential":
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
    from .distill import DistillSet
    from .drafters import load_draft

    out = Path(path)
    meta = json.loads((out / "draft.json").read_text())["meta"]
    cfg = DraftTrainConfig(**meta["train"])
    if model is None:
        from .pretrained import load_pretrained

        model = load_pretrained(cfg.model)[0].eval()
    module, _ = load_draft(out, model)
    ds = data if data is not None else DistillSet.load(cfg.data)
    held = response_batches(ds, cfg.seq_len, cfg.max_eval_batches)
    with _autocast(cfg, model):
        metrics = heldout_metrics(cfg, model, module, held)
    old = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").is_file() else {}
    for key in ("steps", "planned_steps", "curve", "best_step", "train_seconds_this_call", "train_batches",
                "final_loss", "settings", "data_header"):
        if key in old:
            metrics[key] = old[key]
    metrics["heldout_batches"] = len(held)
    _save(cfg, out, model, module, metrics)
    return metrics


def bf16_native(model: Transformer) -> bool:
    """bf16 autocast pays off on GPUs and on CPUs with AVX512-BF16 / AMX; elsewhere bf16 matmuls are emulated
    and slower than fp32 (docs/results/decode-cpu.md: 8.1 s vs 1.3 s for a 693-token prefill on Zen 2)."""
    from .kernels import cpu_info

    dev = model_device(model)
    return dev.type == "cuda" or (dev.type == "cpu" and cpu_info().native_bf16)


def _autocast(cfg: DraftTrainConfig, model: Transformer) -> torch.autocast:
    return torch.autocast(model_device(model).type, dtype=torch.bfloat16, enabled=cfg.bf16 and bf16_native(model))


@torch.no_grad()
def heldout_loss(cfg: DraftTrainConfig, model: Transformer, module: nn.Module,
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The training loss on held-out records (response positions only, `response_batches`), weighted by
    their valid positions: the learning curve and the early-stopping criterion."""
    was = module.training
    module.eval()
    total = weight = 0.0
    dev = model_device(model)
    for tokens, mask in batches:
        tokens, mask = tokens.to(dev), mask.to(dev)
        loss, _ = _loss(cfg, model, module, tokens, mask, 0, None, 0, noise=False)
        w = float(mask.sum())
        total += float(loss) * w
        weight += w
    module.train(was)
    return total / max(weight, 1.0)


def _save(cfg: DraftTrainConfig, out: Path, model: Transformer, module: nn.Module, metrics: dict[str, Any]) -> None:
    """The draft (weights + JSON with the training settings and held-out metrics) and metrics.json."""
    save_draft(out, module, {"train": dataclasses.asdict(cfg), "heldout": metrics}, base=model,
               base_name=cfg.model if not Path(cfg.model).exists() else None)
    (out / "metrics.json").write_text(json.dumps(json_safe(metrics), indent=2))  # NaN -> null: strict JSON


@torch.no_grad()
def heldout_metrics(cfg: DraftTrainConfig, model: Transformer, module: nn.Module,
                    batches: list[tuple[torch.Tensor, torch.Tensor]], ranks: int = 4) -> dict[str, Any]:
    """acc[d][r] (per-rank accuracy at depth d + 1), top1, the anchors counted per depth, and for hidden
    transfer the cosine similarity of pseudo vs real states by block (module docstring)."""
    dev = model_device(model)
    hits: list[torch.Tensor] = []
    counts: list[float] = []
    L = model.cfg.n_layers
    cos_sum: dict[tuple[int, int], float] = {}
    cos_n: dict[tuple[int, int], float] = {}
    with FrozenBase(model):
        for tokens, mask in batches:
            tokens, mask = tokens.to(dev), mask.to(dev)
            T = tokens.shape[1]
            pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (draft logits, target, valid)
            if cfg.method == "hidden-transfer":
                states: dict[int, torch.Tensor] = {}
                real, pseudo = transfer_forward(model, module, tokens, collect=states)
                for i, p in enumerate(pseudo, start=1):
                    pairs.append((p, real[:, i:].argmax(-1), mask[:, i:]))
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
                elif cfg.method == "eagle":
                    if T >= 2:  # depth i: anchors 0..T-1-i, target the base argmax at a + i
                        preds = eagle_forward(model, module, tokens, hs[-1], min(cfg.k, T - 1))
                        for i, fhat in enumerate(preds, start=1):
                            pairs.append((feature_logits(model, fhat), target[:, i:], mask[:, i:]))
                else:
                    pairs.append((module.logits(model, hs[module.layer]), target, mask))
            for d, (lg, tgt, valid) in enumerate(pairs):
                top = lg.float().topk(ranks, -1).indices  # [B, A, ranks]
                h = ((top == tgt[..., None]) & valid[..., None]).sum((0, 1)).float().cpu()
                if d >= len(hits):
                    hits.append(torch.zeros(ranks))
                    counts.append(0.0)
                hits[d] += h
                counts[d] += float(valid.sum())
    acc = [[round(float(x) / max(c, 1.0), 4) for x in h] for h, c in zip(hits, counts)]
    out: dict[str, Any] = {"acc": acc, "top1": [a[0] for a in acc], "anchors": counts}
    if cos_sum:
        steps = sorted({i for i, _ in cos_sum})
        out["cosine"] = {str(i): {str(layer): round(cos_sum[(i, layer)] / max(cos_n[(i, layer)], 1.0), 4)
                                  for (j, layer) in sorted(cos_sum) if j == i} for i in steps}
    return out


# =============================================================================================== train
@dataclass
class DraftRun:
    module: nn.Module
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None


def _state_path(out: Path) -> Path:
    return out / "train_state.pt"


def train_draft(cfg: DraftTrainConfig, model: Transformer | None = None, data: Any = None, *,
                progress: bool = True, stop_after: int | None = None,
                log: Callable[[str], None] = print) -> DraftRun:
    """Train, evaluate on held-out, save (module docstring). `model`/`data` (a DistillSet) may be given to
    skip loading; `stop_after` stops after that many steps in this call (for tests of resume)."""
    from .distill import DistillSet, batches as make_batches

    if model is None:
        from .pretrained import load_pretrained

        model = load_pretrained(cfg.model)[0]
    model.eval()
    ds = data if data is not None else DistillSet.load(cfg.data)
    train_b = make_batches(ds.sequences("train"), cfg.batch_tokens, cfg.seq_len, cfg.seed, pad_id=ds.pad_id)
    held_b = response_batches(ds, cfg.seq_len, cfg.max_eval_batches)
    if not train_b or not held_b:
        raise ValueError(f"{cfg.data}: needs records in both the train and the heldout split")
    total = max(1, math.ceil(cfg.epochs * len(train_b)))
    torch.manual_seed(cfg.seed)
    module = build_module(cfg, model).to(model_device(model))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    phases = _phases(cfg, total)
    step, history, opt_state = 0, [], None
    curve_b = held_b[:cfg.curve_batches] if cfg.curve_batches else held_b
    # learning curve and early stopping: evaluations so far, the best one's weights, evaluations since it
    curve: list[dict[str, Any]] = []
    best: dict[str, Any] = {"loss": math.inf, "step": 0, "module": None}
    stale = 0
    sp = _state_path(out)
    settings = dataclasses.asdict(cfg)
    data_fp = ds.fingerprint()
    if sp.is_file():
        st = torch.load(sp, map_location="cpu", weights_only=True)  # plain dicts, lists, tensors
        if st.get("settings") != settings:
            raise ValueError(f"{sp}: made with other settings; use another --out-dir or delete it to start over")
        if st.get("data", data_fp) != data_fp:
            raise ValueError(f"{sp}: made on other data ({cfg.data} changed since: records added or edited); "
                             "continuing would train on other batches. Use another --out-dir or delete it")
        module.load_state_dict(st["module"])
        step, history, opt_state = st["step"], st["history"], st["opt"]
        curve, best, stale = st.get("curve", []), st.get("best", best), st.get("stale", 0)
        log(f"resuming {cfg.method} at step {step}/{total}")
    autocast = _autocast(cfg, model)
    t0 = time.time()
    done_here = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc=f"train-draft {cfg.method}", unit="step")
    frozen = FrozenStates(cfg, model, module)
    stopped = bool(cfg.patience) and stale >= cfg.patience  # early stop (patience); True: already stopped
    with FrozenBase(model):
        first = 0
        for phase, n in phases:
            if stopped:
                break
            if step >= first + n:
                first += n
                continue
            params = _trainable(cfg, module, phase)
            for p in module.parameters():
                p.requires_grad_(False)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.Adam(params, lr=cfg.lr)
            if opt_state is not None and opt_state.get("phase") == phase:
                opt.load_state_dict(opt_state["state"])
            module.train()
            while step < first + n:
                tokens, mask = train_b[step % len(train_b)]
                dev = model_device(model)
                tokens, mask = tokens.to(dev), mask.to(dev)
                with autocast:
                    cached = frozen.get(step % len(train_b), tokens)
                with torch.enable_grad(), autocast:
                    loss, per = _loss(cfg, model, module, tokens, mask, phase, cached, step)
                if not torch.isfinite(loss.detach()):  # nothing is saved from here on: the state stays good
                    if bar is not None:
                        bar.close()
                    saved = f"{sp} (step {torch.load(sp, weights_only=True)['step']})" if sp.is_file() else "none"
                    raise ValueError(f"non-finite draft loss at step {step + 1}; last saved state: {saved}. "
                                     "Resume with a lower --lr (in a new --out-dir: settings must match)")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                done_here += 1
                history.append({"step": step, "phase": phase, "loss": float(loss.detach()), "per_step": per})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
                evaluated = False
                if cfg.eval_every and step % cfg.eval_every == 0:
                    with autocast:
                        hl = heldout_loss(cfg, model, module, curve_b)
                    recent = [h["loss"] for h in history[-cfg.eval_every:]]
                    curve.append({"step": step, "heldout_loss": round(hl, 6),
                                  "train_loss": round(sum(recent) / len(recent), 6)})
                    if hl < best["loss"]:
                        best = {"loss": hl, "step": step,
                                "module": {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}}
                        stale = 0
                    else:
                        stale += 1
                    evaluated = True
                    log(f"step {step}: held-out loss {hl:.4f} (best {best['loss']:.4f} at step {best['step']})")
                    stopped = bool(cfg.patience) and stale >= cfg.patience
                last = step == first + n or stopped
                if step % cfg.ckpt_every == 0 or last or evaluated or (stop_after and done_here >= stop_after):
                    state = {"settings": settings, "module": module.state_dict(), "step": step, "history": history,
                             "opt": {"phase": phase if not last else -1, "state": opt.state_dict()},
                             "curve": curve, "best": best, "stale": stale, "data": data_fp}
                    atomic_write_bytes(sp, lambda tmp: torch.save(state, tmp))
                if stopped:
                    log(f"early stop at step {step}: no better held-out loss in {cfg.patience} evaluations; "
                        f"keeping step {best['step']}")
                    break
                if stop_after and done_here >= stop_after and step < total:
                    if bar is not None:
                        bar.close()
                    return DraftRun(module, {}, history, out)
            first += n
            opt_state = None
    if bar is not None:
        bar.close()
    if cfg.patience and best["module"] is not None:  # early stopping keeps the best evaluated weights
        module.load_state_dict(best["module"])
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    train_s = time.time() - t0
    with autocast:
        metrics = heldout_metrics(cfg, model, module, held_b)
    metrics.update(steps=step, planned_steps=total, curve=curve, best_step=best["step"] if curve else step,
                   train_seconds_this_call=round(train_s, 1), train_batches=len(train_b),
                   heldout_batches=len(held_b), final_loss=history[-1]["loss"] if history else None,
                   settings=settings, data_header={k: ds.header.get(k) for k in ("model_name", "max_new_tokens")})
    _save(cfg, out, model, module, metrics)
    (out / "history.jsonl").write_text("".join(json.dumps(json_safe(h)) + "\n" for h in history))
    log(f"{cfg.method}: held-out top-1 per step {metrics['top1']}; saved to {out}")
    return DraftRun(module, metrics, history, out)


__all__ = ["DraftTrainConfig", "train_draft", "heldout_metrics", "evaluate_draft", "response_batches", "paper_layers", "build_module", "METHODS"]

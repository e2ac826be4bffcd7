"""Evaluation: validation cross-entropy, per-block gate statistics, estimated FLOPs at measured sparsity.

The paper (section 3) compares models by validation cross-entropy against the *estimated* forward FLOPs of
one sequence at batch 1, assuming the full benefit of the measured gate sparsity (flops.py). We report both
the estimate at the measured sparsity and the dense-equivalent count, so the saving is explicit.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from midlayer.common import atomic_write, autocast_context, cache_dir, resolve_dtype
from midlayer.data.shards import resolve_data, TokenWindows
from midlayer.model.flops import active_param_count, forward_flops, kv_bytes_per_token, param_count
from midlayer.model.sparsity import GateStatsAccumulator
from midlayer.model.transformer import position_tables, Transformer
from midlayer.train import distributed as dist_utils
from .checkpoint import load_model



def kl_rows(base_logits: torch.Tensor, other_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_base || p_other) per row, logits [..., V] -> [...], in fp32 (gradient only through `other`)."""
    t = F.log_softmax(base_logits.detach().float(), -1)
    s = F.log_softmax(other_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1)


@torch.no_grad()
def evaluate(model: Transformer, windows: TokenWindows, *, eval_tokens: int, batch_size: int,
             device: torch.device, dtype: torch.dtype = torch.float32, rank: int = 0,
             world_size: int = 1, equal_forwards: bool = False) -> dict[str, Any]:
    """Token-weighted mean cross-entropy over the first `eval_tokens` validation tokens (0 = all).

    Windows are sequential and split across ranks; the sums are all-reduced, so every rank returns the
    same numbers, equal to a single-process evaluation of the same windows.
    `equal_forwards`: every rank runs as many forwards (a sharded model's forward is a collective: a rank
    that stopped one batch early would leave the others waiting forever); a rank with a batch fewer runs a
    last one on one window whose result is dropped.
    """
    cfg = model.cfg
    was_training = model.training
    model.eval()
    ce_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_tok = torch.zeros((), dtype=torch.float64, device=device)
    acc = GateStatsAccumulator(cfg.n_layers, device=device) if cfg.gating else None
    if equal_forwards:
        mine = -(-len(windows.sequential_windows(eval_tokens, rank, world_size)) // batch_size)  # batches
        extra = dist_utils.all_reduce_max(mine, device) - mine
        if extra:
            x, y = next(windows.sequential(1, max_tokens=windows.seq_len))
            for _ in range(extra):
                with autocast_context(device, dtype):
                    model(x.to(device), y.to(device), return_logits=False)
    for x, y in windows.sequential(batch_size, max_tokens=eval_tokens, rank=rank, world_size=world_size):
        x, y = x.to(device), y.to(device)
        with autocast_context(device, dtype):
            out = model(x, y, return_logits=False)
        ce_sum += out.loss.double() * y.numel()
        n_tok += y.numel()
        if acc is not None:
            s = out.gate_stats
            acc.add(s.mean, s.var, s.zero_frac, s.n_tokens)
    ce_sum, n_tok = dist_utils.all_reduce_sum(ce_sum), dist_utils.all_reduce_sum(n_tok)
    if n_tok.item() == 0:
        raise ValueError("evaluation saw no tokens: the validation split is shorter than one window")
    model.train(was_training)
    ce = (ce_sum / n_tok).item()
    seq_len = windows.seq_len
    result: dict[str, Any] = {
        "val_ce": ce,
        "val_ppl": math.exp(min(ce, 50.0)),
        "val_tokens": int(n_tok.item()),
        "seq_len": seq_len,
        "params": param_count(cfg),
        "gating": cfg.gating,
        "n_layers": cfg.n_layers,
    }
    sparsity = None
    if acc is not None:
        mean, var, zero = acc.reduce()
        sparsity = [float(z) for z in zero[: cfg.n_layers // 2]]
        result.update(gate_mean=[float(m) for m in mean], gate_var=[float(v) for v in var],
                      gate_sparsity=[float(z) for z in zero],
                      mean_sparsity=float(zero.mean()))
    else:
        result.update(mean_sparsity=0.0)
    result["flops_per_seq"] = forward_flops(cfg, seq_len, sparsity).total
    result["flops_per_seq_dense_equiv"] = forward_flops(cfg, seq_len, None).total
    result["active_params"] = float(active_param_count(cfg, sparsity))
    result["kv_bytes_per_token"] = float(kv_bytes_per_token(cfg, 2, sparsity))
    return result


def load_run(run_dir: str | Path, device: str = "cpu") -> tuple[Transformer, Any, Any, Any, int]:
    """(model in eval mode, ModelConfig, TrainConfig, resolved data files, step) of a run's newest checkpoint."""

    model, ckpt, tcfg = load_model(run_dir, device)
    files = resolve_data(tcfg.data, cache_dir(), tcfg.tokenizer_vocab, tcfg.val_data)
    return model.eval(), model.cfg, tcfg, files, int(ckpt["step"])


def rescalable_rope(cfg: Any) -> bool:
    """Whether a model's positions are plain RoPE, which `evaluate_contexts` also rescales zero-shot."""
    return cfg.pos_encoding == "rope" and cfg.rope_scaling == "none"


def evaluate_contexts(run_dir: str | Path, multiples: Sequence[int], device: str = "cpu") -> dict[str, Any]:
    """Validation CE of a finished run's newest checkpoint at its training context x each of `multiples`
    (and x1), over the same number of validation tokens (the run's eval_tokens): how the model does on
    sequences longer than it was trained on. Writes and returns `run_dir/extrapolation.json`:
    {"seq_len": T, "val_ce": {"T": ce, "2T": ce, ...}}. Refuses contexts beyond the model's max_seq_len.

    A model trained with plain RoPE is also evaluated at each m x T with its RoPE tables rescaled by m and
    no training: "val_ce_rope_linear" (position interpolation, Chen et al. 2023: positions / m) and
    "val_ce_rope_ntk" (NTK-aware: theta x m^(d/(d-2))). Seed 004 (L191-193) claims such rescaling extends
    RoPE without fine-tuning; these numbers test that at our scale."""
    import json


    run = Path(run_dir)
    model, mcfg, tcfg, files, step = load_run(run, device)
    dev = torch.device(device)
    lengths = [tcfg.seq_len * m for m in (1, *multiples)]
    if max(lengths) > mcfg.max_seq_len:
        raise ValueError(f"{run}: context {max(lengths)} exceeds the model's max_seq_len={mcfg.max_seq_len}")
    dtype = resolve_dtype(tcfg.dtype, dev)
    out: dict[str, Any] = {"seq_len": tcfg.seq_len, "step": step, "val_ce": {}}

    def ce_at(T: int) -> float:  # the same validation tokens at every length, as many tokens per batch
        return evaluate(model, TokenWindows(files.val, T), eval_tokens=tcfg.eval_tokens,
                        batch_size=max(1, tcfg.micro_batch_size * tcfg.seq_len // T), device=dev,
                        dtype=dtype)["val_ce"]

    for T in lengths:
        out["val_ce"][str(T)] = ce_at(T)
    if rescalable_rope(mcfg):
        for scaling in ("linear", "ntk"):
            key = f"val_ce_rope_{scaling}"
            out[key] = {}
            for m in multiples:
                T = tcfg.seq_len * m
                cos, sin = position_tables(dataclasses.replace(mcfg, rope_scaling=scaling, rope_scale=float(m)), dev)
                model.rope_cos, model.rope_sin = cos, sin  # this function's own copy of the run's model
                out[key][str(T)] = ce_at(T)
    atomic_write(run / "extrapolation.json", writer=lambda tmp: Path(tmp).write_text(json.dumps(out, indent=2)))
    return out


@torch.no_grad()
def compare_models(a: Transformer, b: Transformer, windows: TokenWindows, *, eval_tokens: int,
                   batch_size: int) -> dict[str, Any]:
    """How far apart two models of one architecture are, on the same validation tokens (issue 14: what a seed
    or a last-bit perturbation changes, and where a gated model amplifies it).

    Returned, token-weighted over the first `eval_tokens` tokens (float64 sums):
      ce_a, ce_b: each model's cross-entropy; kl: mean KL(p_a || p_b) per token; top1_agree: fraction of
      positions where the two argmaxes agree; param_rel_dist: ||theta_a - theta_b|| / ||theta_a||.
    Gated models also, per first-half block l (the second half mirrors it, eq. 2):
      gate_abs_diff[l]: mean |g_a - g_b|; zero_flip[l]: fraction of tokens whose gate is exactly 0 in one
      model and not in the other -- the token runs blocks [l, L-1-l] in one and skips them in the other, a
      discrete change that a tiny weight difference can cause; span_differs: fraction of tokens whose first
      zero block (their skipped span) differs.
    """

    same = lambda c: dataclasses.replace(c, gate_grad="exact", attn_backend="auto")  # noqa: E731 (no effect on outputs)
    if same(a.cfg) != same(b.cfg):
        raise ValueError("compare_models: the two models have different configs")
    cfg = a.cfg
    was = (a.training, b.training)
    a.eval(), b.eval()
    dev = next(a.parameters()).device
    half = cfg.n_layers // 2
    sums = dict(n=0.0, ce_a=0.0, ce_b=0.0, kl=0.0, agree=0.0, span=0.0)
    gate_abs = torch.zeros(half, dtype=torch.float64)
    flips = torch.zeros(half, dtype=torch.float64)
    for x, y in windows.sequential(batch_size, max_tokens=eval_tokens):
        x, y = x.to(dev), y.to(dev)
        oa, ob = a(x, y), b(x, y)
        n = float(y.numel())
        sums["n"] += n
        sums["ce_a"] += float(oa.loss) * n
        sums["ce_b"] += float(ob.loss) * n
        sums["kl"] += float(kl_rows(oa.logits, ob.logits).double().sum())
        sums["agree"] += float((oa.logits.argmax(-1) == ob.logits.argmax(-1)).double().sum())
        if cfg.gating:
            ga, gb = oa.gates.reshape(half, -1), ob.gates.reshape(half, -1)  # [L/2, N]
            gate_abs += (ga - gb).abs().double().sum(1).cpu()
            za, zb = ga == 0, gb == 0
            flips += (za != zb).double().sum(1).cpu()
            sums["span"] += float((_first_zero_block(za) != _first_zero_block(zb)).double().sum())
    a.train(was[0]), b.train(was[1])
    if sums["n"] == 0:
        raise ValueError("compare_models: no validation tokens")
    n = sums["n"]
    num = sum(float((pa - pb).double().square().sum()) for pa, pb in zip(a.parameters(), b.parameters()))
    den = sum(float(pa.double().square().sum()) for pa in a.parameters())
    out: dict[str, Any] = {"tokens": int(n), "ce_a": sums["ce_a"] / n, "ce_b": sums["ce_b"] / n,
                           "kl": sums["kl"] / n, "top1_agree": sums["agree"] / n,
                           "param_rel_dist": math.sqrt(num / den)}
    if cfg.gating:
        out.update(gate_abs_diff=(gate_abs / n).tolist(), zero_flip=(flips / n).tolist(), span_differs=sums["span"] / n)
    return out


def _first_zero_block(zero: torch.Tensor) -> torch.Tensor:
    """[L/2, N] bool (gate == 0) -> [N]: each token's first zero block (its skipped span starts there), L/2
    for a token that skips nothing."""
    half = zero.shape[0]
    return torch.where(zero.any(0), zero.int().argmax(0), torch.full_like(zero[0], half, dtype=torch.int64))

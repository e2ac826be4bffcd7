"""Evaluation: validation cross-entropy, per-block gate statistics, estimated FLOPs at measured sparsity.

The paper (section 3) compares models by validation cross-entropy against the *estimated* forward FLOPs of
one sequence at batch 1, assuming the full benefit of the measured gate sparsity (flops.py). We report both
the estimate at the measured sparsity and the dense-equivalent count, so the saving is explicit.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from . import distributed as dist_utils
from .data import TokenWindows
from .flops import active_param_count, forward_flops, kv_bytes_per_token, param_count
from .model import Transformer
from .sparsity import GateStatsAccumulator


def autocast_context(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model: Transformer, windows: TokenWindows, *, eval_tokens: int, batch_size: int,
             device: torch.device, dtype: torch.dtype = torch.float32, rank: int = 0,
             world_size: int = 1) -> dict[str, Any]:
    """Token-weighted mean cross-entropy over the first `eval_tokens` validation tokens (0 = all).

    Windows are sequential and split across ranks; the sums are all-reduced, so every rank returns the
    same numbers, equal to a single-process evaluation of the same windows.
    """
    cfg = model.cfg
    was_training = model.training
    model.eval()
    ce_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_tok = torch.zeros((), dtype=torch.float64, device=device)
    acc = GateStatsAccumulator(cfg.n_layers, device=device) if cfg.gating else None
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


def evaluate_contexts(run_dir: str | Path, multiples: Sequence[int], device: str = "cpu") -> dict[str, Any]:
    """Validation CE of a finished run's newest checkpoint at its training context x each of `multiples`
    (and x1), over the same number of validation tokens (the run's eval_tokens): how the model does on
    sequences longer than it was trained on. Writes and returns `run_dir/extrapolation.json`:
    {"seq_len": T, "val_ce": {"T": ce, "2T": ce, ...}}. Refuses contexts beyond the model's max_seq_len."""
    import json

    from .checkpoint import atomic_write_bytes, list_checkpoints, load_checkpoint
    from .config import ModelConfig, TrainConfig, from_dict
    from .data import resolve_data
    from .train import default_cache_dir, resolve_dtype

    run = Path(run_dir)
    ckpts = list_checkpoints(run)
    if not ckpts:
        raise ValueError(f"{run}: no checkpoint to evaluate")
    ckpt = load_checkpoint(ckpts[-1])
    mcfg = from_dict(ModelConfig, ckpt["configs"]["model"])
    tcfg = from_dict(TrainConfig, ckpt["configs"]["train"])
    lengths = [tcfg.seq_len * m for m in (1, *multiples)]
    if max(lengths) > mcfg.max_seq_len:
        raise ValueError(f"{run}: context {max(lengths)} exceeds the model's max_seq_len={mcfg.max_seq_len}")
    dev = torch.device(device)
    model = Transformer(mcfg).to(dev)
    model.load_state_dict(ckpt["model"])
    files = resolve_data(tcfg.data, default_cache_dir(), tcfg.tokenizer_vocab, tcfg.val_data)
    dtype = resolve_dtype(tcfg.dtype, dev)
    out: dict[str, Any] = {"seq_len": tcfg.seq_len, "step": ckpt["step"], "val_ce": {}}
    for T in lengths:
        res = evaluate(model, TokenWindows(files.val, T), eval_tokens=tcfg.eval_tokens,
                       batch_size=max(1, tcfg.micro_batch_size * tcfg.seq_len // T), device=dev, dtype=dtype)
        out["val_ce"][str(T)] = res["val_ce"]
    atomic_write_bytes(run / "extrapolation.json", lambda tmp: Path(tmp).write_text(json.dumps(out, indent=2)))
    return out

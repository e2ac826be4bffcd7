"""Training throughput of the `tiny` preset against Hugging Face `LlamaForCausalLM`, as a ratio from one run.

    midlayer bench train                      # fp32, the tiny preset's batch (16 x 256)
    midlayer bench train --dtype bfloat16     # both sides under torch.autocast("cpu", bf16)

Models (one process, same random tokens, same thread count):

  (a) ours, `tiny-dense` with norm_placement="pre": pre-LN, RMSNorm, SwiGLU, RoPE, untied embeddings, no
      biases -- the architecture of Hugging Face's Llama. The one structural difference is our RMSNorm after
      the token embedding (`emb_norm`, `dim` parameters); the parameter counts are asserted equal up to it;
  (b) Hugging Face `LlamaForCausalLM` with the same sizes, `attn_implementation="sdpa"`, `use_cache=False`;
  (c) ours, `tiny` (gated, sandwich norm) with its proportional controller loss and update -- for information;
  (d) ours, `tiny-dense` (sandwich norm) -- for information.

One timed step is what `midlayer.train.loop` does per optimizer step with one micro-batch: forward with the loss
(plus the controller's loss for the gated model), backward, the gradient-norm measurement the trainer always
makes (`clip_grad_norm_(..., inf)`; `--no-grad-norm` drops it), AdamW with the TrainConfig betas/eps,
`zero_grad(set_to_none=True)` and reading the loss back with `.item()`. The LR scheduler and logging are left
out (negligible). Every model gets the same step.

CPU timings drift (frequency, other processes), so models are timed in rounds: each round times `--steps`
steps of every model back to back (the order alternates between rounds: A B C D, then D C B A), and the table
reports the median over `--repeats` rounds. The headline ratio ours/HF is the median of the per-round ratios
of (a) and (b), which were measured seconds apart; the ratio of the medians is shown beside it. Each timing
also records the process's CPU seconds per wall second: when another job takes cores from this one that drops,
and rounds where any model fell below 85% of its best are left out of the medians (the table says how many
were kept). Check the machine is otherwise idle first, e.g. `pgrep -f "midlayer demo|midlayer sweep|pytest"`.
Written up in docs/results/train-throughput-cpu.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from midlayer.config import get_preset
from midlayer.common import autocast_context
from midlayer.model.transformer import Transformer
from midlayer.model.sparsity import GateStatsAccumulator, make_controller
from midlayer.train.loop import micro_batch_losses


@dataclass
class Bench:
    key: str
    label: str
    n_params: int
    step: Callable[[], float]  # one training step; returns the loss as a float
    note: str = ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_steal() -> tuple[int, int]:
    """(steal, total) jiffies from /proc/stat: time the hypervisor gave this VM's vCPUs to someone else."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (fields[7] if len(fields) > 7 else 0), sum(fields)
    except (OSError, ValueError):
        return 0, 0


def autocast(dtype: torch.dtype, device: str = "cpu"):
    return autocast_context(torch.device(device), dtype)


def make_optimizer(params, train_cfg, fused: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
                             eps=train_cfg.adam_eps, weight_decay=train_cfg.weight_decay,
                             **({"fused": True} if fused else {}))


def ours(preset: str, key: str, label: str, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype,
         grad_norm: bool, *, compiled: bool = False, fused: bool = False, **model_overrides
         ) -> tuple[Bench, Transformer]:
    """midlayer.train.loop's step for `preset` on x's device: `train.micro_batch_losses` (the objective itself),
    backward, the gradient-norm measurement (`grad_norm`), AdamW (`fused`: the fused kernel, CUDA), the
    controller's update. `compiled`: the model under torch.compile, as `--compile` trains it."""
    model_cfg, sparsity_cfg, train_cfg = get_preset(preset, model=model_overrides)
    torch.manual_seed(0)
    model = Transformer(model_cfg).to(x.device)
    model.check_inputs = x.device.type == "cpu"  # as midlayer.train.loop does
    model.train()
    fwd = torch.compile(model) if compiled else model
    opt = make_optimizer(model.parameters(), train_cfg, fused)
    controller = make_controller(sparsity_cfg, model_cfg.n_layers) if model_cfg.gating else None
    acc = GateStatsAccumulator(model_cfg.n_layers) if controller is not None else None
    params = list(model.parameters())

    def step() -> float:
        with autocast(dtype, x.device.type):
            out, reg, moe = micro_batch_losses(fwd, x, y, model_cfg, sparsity_cfg, controller)
        (out.loss + reg + moe).backward()
        if grad_norm:
            torch.nn.utils.clip_grad_norm_(params, float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if controller is not None:
            s = out.gate_stats
            acc.reset()
            acc.add(s.mean, s.var, s.zero_frac, s.n_tokens)
            g_mean, g_var, _ = acc.reduce()
            controller.update(g_mean, g_var)
        return out.loss.item()

    return Bench(key, label, model.num_params(), step), model


def hf_llama(x: torch.Tensor, dtype: torch.dtype, grad_norm: bool, model_cfg,
             train_cfg) -> tuple[Bench, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.dim, intermediate_size=model_cfg.ffn_hidden_dim,
        num_hidden_layers=model_cfg.n_layers, num_attention_heads=model_cfg.n_heads,
        num_key_value_heads=model_cfg.n_kv_heads, max_position_embeddings=model_cfg.max_seq_len,
        rms_norm_eps=model_cfg.norm_eps, rope_theta=model_cfg.rope_theta, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=model_cfg.init_std,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    opt = make_optimizer(model.parameters(), train_cfg)
    params = list(model.parameters())

    def step() -> float:
        with autocast(dtype):
            out = model(input_ids=x, labels=x, use_cache=False)  # HF shifts the labels itself
        out.loss.backward()
        if grad_norm:
            torch.nn.utils.clip_grad_norm_(params, float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item()

    n = sum(p.numel() for p in model.parameters())
    return Bench("b", "HF `LlamaForCausalLM` (sdpa)", n, step), model


def check_same_sizes(ours_model: Transformer, hf_model) -> None:
    """Ours (pre-LN dense) and HF Llama hold the same tensors, except our extra `emb_norm`."""
    ours_shapes = sorted(tuple(p.shape) for n, p in ours_model.named_parameters() if not n.startswith("emb_norm."))
    hf_shapes = sorted(tuple(p.shape) for p in hf_model.parameters())
    assert ours_shapes == hf_shapes, "parameter shapes differ between ours (pre, dense) and HF Llama"
    n_ours = ours_model.num_params() - ours_model.emb_norm.weight.numel()
    n_hf = sum(p.numel() for p in hf_model.parameters())
    assert n_ours == n_hf, f"parameter counts differ: ours {n_ours} (without emb_norm) vs HF {n_hf}"
    impl = getattr(hf_model.config, "_attn_implementation", None)
    assert impl == "sdpa", f"HF model uses attn_implementation={impl!r}, expected 'sdpa'"


def main(argv: list[str] | None = None) -> int:
    """`python -m midlayer.experiments.train_bench`; `midlayer bench train` is the same."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), p.error)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2, help="timed training steps per model per round (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model before the rounds (default 3)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the tiny preset's, 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the tiny preset's, 256)")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds; medians are over these (default 15)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: torch.autocast('cpu', bfloat16) around the forward, for every model")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--no-grad-norm", action="store_true",
                   help="skip the clip_grad_norm_ measurement midlayer.train.loop makes every step")
    p.add_argument("--only", default="abcd", help="subset of models to run, e.g. 'ab' (default abcd)")


def run(args: argparse.Namespace, error: Callable[[str], None] | None = None) -> int:
    """The rounds and the table. `error` reports a bad flag (argparse's, or a ValueError)."""
    def fail(msg: str) -> None:
        if error is not None:
            error(msg)
        raise ValueError(msg)

    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        fail("--warmup must be >= 0")
    if args.threads is not None:
        if args.threads < 1:
            fail("--threads must be >= 1")
        torch.set_num_threads(args.threads)

    for name in ("batch", "seq_len"):  # (0 meant the default, a negative one a traceback)
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if not args.only or set(args.only) - set("abcd"):  # (checked after four models were built; others dropped)
        fail(f"--only: letters among a, b, c, d, got {args.only!r}")
    model_cfg, _, train_cfg = get_preset("tiny")
    batch = train_cfg.micro_batch_size if args.batch is None else args.batch
    seq_len = train_cfg.seq_len if args.seq_len is None else args.seq_len
    if seq_len > model_cfg.max_seq_len:
        fail(f"--seq-len {seq_len} exceeds the tiny preset's max_seq_len={model_cfg.max_seq_len}")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    grad_norm = not args.no_grad_norm

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, model_cfg.vocab_size, (batch, seq_len + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    a, ours_pre = ours("tiny-dense", "a", "ours `tiny-dense`, norm_placement=pre", x, y, dtype, grad_norm,
                       norm_placement="pre")
    b, hf = hf_llama(x, dtype, grad_norm, model_cfg, train_cfg)
    check_same_sizes(ours_pre, hf)
    a.note = f"= HF + {ours_pre.emb_norm.weight.numel()} (`emb_norm`)"
    c, _ = ours("tiny", "c", "ours `tiny` (gated, sandwich, proportional controller)", x, y, dtype, grad_norm)
    d, _ = ours("tiny-dense", "d", "ours `tiny-dense` (sandwich)", x, y, dtype, grad_norm)
    benches = [bn for bn in (a, b, c, d) if bn.key in args.only]
    if not benches:
        fail("--only selects no model")

    tokens_per_step = batch * seq_len
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rates, util, losses, steal = _timed_rounds(benches, args.warmup, args.steps, args.repeats, tokens_per_step)
    _report(args, benches, rates, util, losses, steal, batch, seq_len, load_before, grad_norm, train_cfg)
    return 0


def _timed_rounds(benches: list[Bench], warmup: int, steps: int, repeats: int, tokens_per_step: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float], list[float]]:
    """Warm-up, then `repeats` rounds of `steps` steps per model, the order alternating between rounds: tokens/s
    and CPU utilisation per model and round, each model's last loss, the hypervisor's steal per round."""
    print(f"# warmup: {warmup} steps per model", file=sys.stderr)
    for _ in range(warmup):  # interleaved too, so every model warms up under the same conditions
        for bn in benches:
            bn.step()
    rates: dict[str, list[float]] = {bn.key: [] for bn in benches}
    util: dict[str, list[float]] = {bn.key: [] for bn in benches}  # process CPU seconds per wall second
    losses: dict[str, float] = {}
    steal: list[float] = []
    for r in range(repeats):
        order = benches if r % 2 == 0 else benches[::-1]
        s0, t0_all = cpu_steal()
        for bn in order:
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                losses[bn.key] = bn.step()
            c1, t1 = time.process_time(), time.perf_counter()
            rates[bn.key].append(steps * tokens_per_step / (t1 - t0))
            util[bn.key].append((c1 - c0) / (t1 - t0))
        s1, t1_all = cpu_steal()
        steal.append(100.0 * (s1 - s0) / max(1, t1_all - t0_all))
        print(f"# round {r + 1}/{repeats}: "
              + ", ".join(f"({k}) {v[-1]:.0f} tok/s cpu {util[k][-1]:.2f}" for k, v in rates.items())
              + f"; steal {steal[-1]:.0f}%", file=sys.stderr)

    return rates, util, losses, steal


def _report(args: argparse.Namespace, benches: list[Bench], rates: dict[str, list[float]],
            util: dict[str, list[float]], losses: dict[str, float], steal: list[float], batch: int, seq_len: int,
            load_before: float, grad_norm: bool, train_cfg) -> None:
    """The table: medians over the clean rounds, and the headline ratio ours/HF with its verdict."""
    tokens_per_step = batch * seq_len
    # Other processes on the machine take cores from ours: our CPU time per wall second drops while theirs
    # runs. A round is "clean" when every model's utilisation is within 85% of its best round.
    best = {k: max(v) for k, v in util.items()}
    clean = [r for r in range(args.repeats) if all(util[k][r] >= 0.85 * best[k] for k in util)]
    use = clean if len(clean) >= max(3, args.repeats // 3) else list(range(args.repeats))
    med = {k: statistics.median([v[r] for r in use]) for k, v in rates.items()}
    med_all = {k: statistics.median(v) for k, v in rates.items()}

    print(f"Training throughput, {args.dtype}, batch {batch} x seq {seq_len} = {tokens_per_step} tokens/step, "
          f"{args.steps} steps x {args.repeats} interleaved rounds after {args.warmup} warmup steps per model.")
    print()
    print(f"- date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"- torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"python {platform.python_version()}")
    print(f"- CPU: {cpu_model()}; torch threads: {torch.get_num_threads()}; os.cpu_count {os.cpu_count()}; "
          f"1-min load average before the timed rounds {load_before:.2f}")
    print(f"- step: forward+loss, backward, {'grad-norm, ' if grad_norm else ''}AdamW "
          f"(betas {train_cfg.beta1}/{train_cfg.beta2}, eps {train_cfg.adam_eps}), zero_grad, loss.item()")
    print(f"- clean rounds (every model's CPU utilisation >= 85% of its best round): {len(clean)}/{args.repeats}"
          + ("" if use is clean else " -- too few, so the medians below use ALL rounds; rerun on a quiet machine")
          + f"; hypervisor steal per round: median {statistics.median(steal):.0f}%, max {max(steal):.0f}%")
    print()
    print("| model | params | median tokens/s | ms/step | median, all rounds | min | max | last loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for bn in benches:
        v = rates[bn.key]
        params = f"{bn.n_params:,}" + (f" {bn.note}" if bn.note else "")
        print(f"| ({bn.key}) {bn.label} | {params} | {med[bn.key]:,.0f} | {1000 * tokens_per_step / med[bn.key]:.0f} | "
              f"{med_all[bn.key]:,.0f} | {min(v):,.0f} | {max(v):,.0f} | {losses[bn.key]:.3f} |")
    if "a" in rates and "b" in rates:
        per_round = [rates["a"][r] / rates["b"][r] for r in use]
        ratio = statistics.median(per_round)
        q1, _, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else (ratio, ratio, ratio)
        all_ratio = statistics.median([ra / rb for ra, rb in zip(rates["a"], rates["b"])])
        if q1 >= 1:
            verdict = "met"
        elif q3 < 1:
            verdict = "NOT met"
        else:
            verdict = (f"{'met' if ratio >= 1 else 'not met'} at the median; the difference is within noise "
                       "(the interquartile range spans 1)")
        print()
        print(f"**ours/HF, (a)/(b): {ratio:.3f}** -- median of the per-round ratios over {len(use)} "
              f"{'clean' if use is clean else ''} rounds, interquartile range {q1:.3f}-{q3:.3f}; "
              f"ratio of the medians {med['a'] / med['b']:.3f}; median over all rounds {all_ratio:.3f}. "
              f"Target (ours >= HF): {verdict}.")


if __name__ == "__main__":
    raise SystemExit(main())

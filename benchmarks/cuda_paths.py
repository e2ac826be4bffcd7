"""The CUDA paths, run for real on one GPU: FlexAttention (compiled) against SDPA with a key bias, and the
training step's throughput per attention backend, torch.compile and dtype.

    python benchmarks/cuda_paths.py                     # the paper's 12-layer model, batch 8 x 1024
    python benchmarks/cuda_paths.py --preset tiny --batch 16 --seq-len 256

1. Equality. The gated model's attention (eq. 3: keys of skipped tokens are down-weighted by log g) has two
   implementations, `flex_gated_attention` (a `score_mod` on kv_idx, compiled on CUDA: attention.py `_flex`)
   and `sdpa_attention` with an additive key bias. The same weights run both ways; the table gives the largest
   logit difference and the relative difference of every parameter gradient, in fp32 (TF32 off) and under bf16
   autocast. CPU tests check the eager FlexAttention; this is the compiled kernel the CUDA path really runs.
2. Throughput. One timed step is `midlayer bench train`'s `ours` (experiments/train_bench.py) on CUDA, i.e. midlayer.train.loop's
   step: `train.micro_batch_losses` (LM loss plus the controller's loss for gated models), backward, the
   gradient-norm measurement, AdamW (fused here), the controller's update, `.item()` of the loss. Rows: dense
   and gated, SDPA and Flex, eager and compiled. (The H100 rows of docs/results/cuda-h100.md were measured
   before this step was shared, without the gradient-norm measurement.)
   Timings: CUDA-synchronised wall time, median over --repeats rounds of --steps steps after --warmup steps.

Needs a CUDA GPU (it refuses to run without one); nothing else in midlayer needs one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from midlayer.config import get_preset  # noqa: E402
from midlayer.model.transformer import Transformer  # noqa: E402
from midlayer.experiments.train_bench import ours  # noqa: E402  (the one timed training step)


def build(preset: str, **model_over) -> tuple[Transformer, object, object]:
    model_cfg, sparsity_cfg, train_cfg = get_preset(preset, model=model_over)
    torch.manual_seed(0)
    return Transformer(model_cfg).cuda(), sparsity_cfg, train_cfg


def equality(preset: str, x: torch.Tensor, y: torch.Tensor) -> list[tuple[str, float, float, str, float]]:
    """(dtype, max |logit diff|, max relative gradient diff, the parameter where it is, |loss diff|) of flex vs
    sdpa, same weights."""
    rows = []
    ref, _, _ = build(preset, attn_backend="sdpa", gating=True)
    flex, _, _ = build(preset, attn_backend="flex", gating=True)
    flex.load_state_dict(ref.state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for m in (ref, flex):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = m(x, y)
            out.loss.backward()
            outs.append((out.logits.float().detach(), out.loss.item(),
                         {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}))
        (la, lossa, ga), (lb, lossb, gb) = outs
        rel, worst = max((((ga[n] - gb[n]).norm() / ga[n].norm().clamp_min(1e-30)).item(), n) for n in ga)
        rows.append((str(dtype).replace("torch.", ""), (la - lb).abs().max().item(), rel,
                     f"{worst} (grad norm {ga[worst].norm().item():.2e})", abs(lossa - lossb)))
    return rows


def throughput(preset: str, x: torch.Tensor, y: torch.Tensor, gating: bool, backend: str, compiled: bool,
               dtype: torch.dtype, warmup: int, steps: int, repeats: int) -> tuple[float, float]:
    """(median seconds per step, peak GPU memory in GiB) of train_bench.py's step -- midlayer.train.loop's --
    on CUDA, with the fused AdamW."""
    bench, model = ours(preset, "", "", x, y, dtype, True, compiled=compiled, fused=True,
                        attn_backend=backend, gating=gating)
    step = bench.step

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps)
    mem = torch.cuda.max_memory_allocated() / 2**30
    del model, bench, step
    torch.cuda.empty_cache()
    return statistics.median(times), mem


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="paper-12l", help="a config preset (default paper-12l)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per row (compilation happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported (default 3)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/cuda_paths.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the equality table compares fp32 with fp32
    torch.backends.cudnn.allow_tf32 = False
    cfg = get_preset(a.preset)[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len), generator=g).cuda()
    y = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len), generator=g).cuda()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, preset {a.preset}, "
          f"batch {a.batch} x {a.seq_len}")
    print("\n## FlexAttention (compiled) vs SDPA + key bias, gated model, same weights\n")
    print("| dtype | max abs logit diff | max rel grad diff | at parameter | abs loss diff |\n"
          "| --- | --- | --- | --- | --- |")
    for dt, dl, dg, where, dloss in equality(a.preset, x[:2], y[:2]):
        print(f"| {dt} | {dl:.2e} | {dg:.2e} | {where} | {dloss:.2e} |")
    torch.backends.cuda.matmul.allow_tf32 = True  # training throughput as a user runs it
    print(f"\n## Training step ({a.batch * a.seq_len} tokens), median of {a.repeats} x {a.steps} steps\n")
    print("| model | attention | compile | dtype | ms/step | tokens/s | peak GiB |\n| --- | --- | --- | --- | --- | --- | --- |")
    rows = [(False, "sdpa", False), (False, "sdpa", True), (True, "sdpa", False), (True, "flex", False),
            (True, "sdpa", True), (True, "flex", True)]
    for dtype in (torch.bfloat16,):
        for gating, backend, compiled in rows:
            try:
                s, mem = throughput(a.preset, x, y, gating, backend, compiled, dtype, a.warmup, a.steps, a.repeats)
                print(f"| {'gated' if gating else 'dense'} | {backend} | {'yes' if compiled else 'no'} | "
                      f"{str(dtype).replace('torch.', '')} | {s * 1e3:.1f} | {a.batch * a.seq_len / s:,.0f} | "
                      f"{mem:.1f} |", flush=True)
            except Exception as e:  # a failing row is a finding, not the end of the table
                print(f"| {'gated' if gating else 'dense'} | {backend} | {'yes' if compiled else 'no'} | "
                      f"{str(dtype).replace('torch.', '')} | failed: {type(e).__name__}: {str(e)[:200]} | | |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

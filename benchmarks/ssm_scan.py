"""Forward + backward time of the selective scan's two forms (midlayer/model/ssm.py), interleaved, as a table.

    python benchmarks/ssm_scan.py                       # the parts sweep's shapes: Bt 16, T 256, d_in 256, N 16
    python benchmarks/ssm_scan.py --T 1024 --repeats 5

Why: `SelectiveSSM(scan="auto")` picks the sequential scan on CPU and the chunked one elsewhere; this is the
measurement behind that choice. Each round times every form once (the order reverses every round) and the
table gives the median over rounds and the ratio to the sequential scan. Check the machine is idle first.
Written up in docs/results/parts-cpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from midlayer.ops.kernels import cpu_info  # noqa: E402
from midlayer.model.ssm import scan_chunked, scan_sequential  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--d-in", type=int, default=256)
    ap.add_argument("--N", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks", default="4,16", help="chunk sizes of the chunked form, comma-separated")
    args = ap.parse_args(argv)
    try:
        chunks = [int(x) for x in args.chunks.split(",")]
    except ValueError:
        ap.error(f"--chunks must be comma-separated integers, got {args.chunks!r}")
    if min(args.batch, args.T, args.d_in, args.N, args.repeats, *chunks) < 1:
        ap.error("--batch, --T, --d-in, --N, --repeats and every chunk must be >= 1")
    torch.manual_seed(0)
    Bt, T, D, N = args.batch, args.T, args.d_in, args.N
    u = torch.randn(Bt, T, D, requires_grad=True)
    B, C = torch.randn(Bt, T, N), torch.randn(Bt, T, N)
    delta = F.softplus(torch.randn(Bt, T, D) - 3)
    A = -torch.arange(1, N + 1.0).expand(D, N)  # Mamba's S4D-real initialisation
    forms = {"sequential": lambda: scan_sequential(u, delta, A, B, C)}
    for c in chunks:
        forms[f"chunked (chunk {c})"] = lambda c=c: scan_chunked(u, delta, A, B, C, chunk=c)
    times: dict[str, list[float]] = {k: [] for k in forms}
    names = list(forms)
    for r in range(args.repeats + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            y, _ = forms[name]()
            y.sum().backward()
            u.grad = None
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["sequential"])
    print(f"selective scan, forward + backward: Bt {Bt}, T {T}, d_in {D}, N {N}, median of {args.repeats} "
          f"interleaved rounds; {cpu_info().summary()}")
    print("| form | seconds | vs sequential |\n|---|---|---|")
    for name in names:
        med = statistics.median(times[name])
        print(f"| {name} | {med:.3f} | {med / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

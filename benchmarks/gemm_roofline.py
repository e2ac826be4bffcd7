"""How close the q4 GEMM runs to this CPU's int8 dot-product peak, by rows (issue 45's 16-client question).

A batched decode step's cost is mostly its q4 GEMMs (`benchmarks/step_parts.py`). Once a GEMM is compute-bound,
a forward over R rows costs R times one row's multiply-adds and batching stops paying. This script measures:

  * the peak: a small C loop of independent 8-bit dot-product instructions (`vpdpbusd` on 512-bit registers
    where the CPU has AVX512-VNNI, else AVX2's `vpmaddubsw` + `vpmaddwd` + `vpaddd`, the sequence the AVX2 tile
    uses), compiled with the kernels' own compiler, one copy per thread run at once;
  * the q4 GEMM (`kernels.gemm_q4_1`) at SmolLM2-135M's shapes for 1..64 rows: multiply-adds per second, their
    share of that peak, and each row count's time over one row's.

    python benchmarks/gemm_roofline.py [--rows 1 4 8 16 64]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from midlayer.experiments.bench import machine_line
from midlayer.ops import kernels

# SmolLM2-135M's linears (K in, N out): fused q/k/v, attention output, fused gate/up, down, the head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]

_PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define CHAINS 24  /* independent accumulators: enough to cover the instruction's latency */
#ifdef ZMM
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double run(long n) {
    __m512i a[CHAINS], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_epi32(i);
    for (long j = 0; j < n; j++) {
        for (int i = 0; i < CHAINS; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
        __asm__ volatile("" : "+v"(w));
    }
    int r = 0;
    for (int i = 0; i < CHAINS; i++) r += _mm512_reduce_add_epi32(a[i]);
    return 64.0 * CHAINS * n + (r & 1) * 1e-9;  /* multiply-adds: 16 lanes x 4 bytes each */
}
#else
__attribute__((target("avx2"))) static double run(long n) {
    __m256i a[CHAINS], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_epi32(i);
    for (long j = 0; j < n; j++) {
        for (int i = 0; i < CHAINS; i++)
            a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
        __asm__ volatile("" : "+v"(w));
    }
    int r = 0;
    for (int i = 0; i < CHAINS; i++) r += _mm256_extract_epi32(a[i], 0);
    return 32.0 * CHAINS * n + (r & 1) * 1e-9;  /* multiply-adds: 32 bytes */
}
#endif
int main(void) {
    long n = 40000000;
    struct timespec t0, t1;
    run(n / 10);  /* warm-up: clocks up */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double macs = run(n);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.6e\n", macs / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec)));
    return 0;
}
"""


def dot_peak(threads: int) -> tuple[float, str]:
    """(multiply-adds per second, all threads together; the instruction measured)."""
    cc = kernels._compiler()
    if cc is None:
        raise SystemExit("no C compiler: the peak probe needs one (as the kernels do)")
    zmm = kernels.cpu_info().has("avx512_vnni") and kernels.cpu_info().has("avx512bw")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        src.write_text(_PROBE)
        subprocess.run([cc, "-O2", *(["-DZMM"] if zmm else []), str(src), "-o", str(exe)], check=True)
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(threads)]
        rate = sum(float(p.communicate()[0]) for p in procs)
    return rate, "vpdpbusd zmm (AVX512-VNNI)" if zmm else "vpmaddubsw + vpmaddwd + vpaddd (AVX2)"


def gemm_seconds(M: int, K: int, N: int, rounds: int) -> float:
    """Median seconds of one q4 GEMM of M rows, K -> N (random weights; the kernel's time does not depend on them)."""
    torch.manual_seed(0)
    packed, scales = kernels.quantize_q4_1(torch.randn(N, K))
    x = torch.randn(M, K)
    kernels.gemm_q4_1(x, packed, scales)
    reps = max(2, int(4e8 / (M * K * N)))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            kernels.gemm_q4_1(x, packed, scales)
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if kernels.library() is None:
        raise SystemExit(f"the kernels are not built: {kernels.unavailable_reason()}")
    threads = torch.get_num_threads()
    print(machine_line(), "\n")
    peak, what = dot_peak(threads)
    print(f"peak: {what}, {threads} copies at once: {peak / 1e9:.0f} G multiply-adds/s\n")
    print("| rows | GEMM ms (SmolLM2's linears, one forward) | G multiply-adds/s | share of peak | time / one row's |")
    print("|---|---|---|---|---|")
    base = None
    for M in args.rows:
        sec = sum(gemm_seconds(M, K, N, args.rounds) for K, N in SHAPES[:4]) * 30 + gemm_seconds(M, *SHAPES[4],
                                                                                                 args.rounds)
        macs = M * (30 * sum(K * N for K, N in SHAPES[:4]) + SHAPES[4][0] * SHAPES[4][1])
        if M == 1:
            base = sec
        ratio = "-" if base is None else f"{sec / base:.2f}"
        print(f"| {M} | {sec * 1e3:.2f} | {macs / sec / 1e9:.0f} | {macs / sec / peak:.0%} | {ratio} |")


if __name__ == "__main__":
    main()

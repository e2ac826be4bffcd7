"""The q4 format's C kernels (midlayer/ops/kernels.py, csrc/qkernels.c): bit-identical to their PyTorch
reference, AVX2 == portable scalar path, and row-invariant -- so a row's logits do not depend on how many
rows share its forward, and speculative output equals plain greedy output token for token."""

from __future__ import annotations

import os
import subprocess
from fractions import Fraction
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from midlayer.ops import kernels
from midlayer.model.attention import apply_rope
from midlayer.engine.generate import GenerationConfig, JoinedRows, forward_cached, generate
from midlayer.model.kv_cache import KVCache
from midlayer.engine.quantization import compress_weights
from midlayer.speculative.tree import DraftTree
from midlayer.speculative.verify import speculative_generate
from tiny_models import OracleDrafter, RandomDrafter, make_tiny

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the q4 kernels are not built")

V = 96
DIMS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=64, multiple_of=32)


@pytest.fixture(params=[True, False], ids=["avx2", "scalar"])
def simd(request):
    kernels.set_simd(request.param)
    yield request.param
    kernels.set_simd(True)


def simd_level() -> int:
    """The SIMD level the kernels use now (index into kernels.SIMD_LEVELS); -1 without the compiled kernels."""
    lib = kernels.library()
    return -1 if lib is None else lib.qk_simd_level()


def test_every_simd_level_gives_the_same_gemm_bits():
    """Scalar, AVX2 and (where the CPU has them) the AVX512-VNNI tiles on 256- and 512-bit registers: the
    block sums are exact integers and the float work is the same operation sequence, so every level gives
    the same bits, for 1..9 rows (tiles of 4, 2, 1) and outputs that are not a multiple of 8 or 16: N = 101
    is 13 groups of 8 (the 512-bit level's last work item has one group: the 256-bit tile), N = 90 is 12
    (its last pair of groups holds 10 outputs: a masked 16-lane store). K = 256 and 1536: the 512-bit
    tiles' prefetch runs past a pair's end into the next pair's groups. Each level runs its own tiles
    (`qk_gemm_tiles`): a level sent to another's would give the same bits and test nothing."""
    info = kernels.cpu_info()
    levels = kernels.simd_levels()
    assert levels[:2] == [0, 1] or not info.has("avx2")
    if info.has("avx512_vnni") and info.has("avx512vl"):  # detection picks the VNNI tiles where the CPU has them
        assert levels == ([0, 1, 2, 3] if info.has("avx512bw") else [0, 1, 2])
    for N, K in ((101, 256), (90, 256), (40, 1536)):
        w, x = _weights(N, K, seed=9)
        packed, scales = kernels.quantize_q4_1(w)
        codes, d = kernels.quantize_q8_0(w)
        out = {}
        try:
            for level in levels:
                kernels.set_simd(level)
                assert simd_level() == level
                assert kernels.simd_levels() == levels and simd_level() == level  # asking changes nothing
                assert kernels.library().qk_gemm_tiles() == level | level << 8  # this level's own tiles run
                out[level] = [(kernels.gemm_q4_1(x[:M], packed, scales, N), kernels.gemm_q8_0(x[:M], codes, d, N))
                              for M in range(1, 10)]
        finally:
            kernels.set_simd(True)
        assert simd_level() == levels[-1]
        for level in levels[1:]:
            for (a4, a8), (b4, b8) in zip(out[0], out[level]):
                assert torch.equal(a4, b4) and torch.equal(a8, b8), (N, level)
        assert torch.equal(out[0][3][0], kernels.gemm_q4_1_reference(x[:4], packed, scales, N))
        assert torch.equal(out[0][3][1], kernels.gemm_q8_0_reference(x[:4], codes, d, N))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through ctypes: Linux")
def test_no_simd_level_reads_a_weight_byte_past_the_last_group():
    """Codes and scales end at an unreadable (PROT_NONE) page, as the last tensor of a memory-mapped weight file
    may: no SIMD level reads past the last output group. The 512-bit tiles take groups in pairs, and a lone last
    group must go to the 256-bit tile (a pair tile over it read a group that is not there: the bits were right,
    the lanes past the end being never stored, but the read crosses the page). N = 8, 40, 101: 1, 5 and 13
    groups; M = 1, 8, 9 (the 8-row tile and the one-row tile after it). Likewise the fp32 linear's weight and
    activations, whose K tail is a masked load. A read past the end is a SIGSEGV, so the check runs in a child
    process; every level must also give the scalar bits."""
    code = textwrap.dedent("""
        import ctypes, mmap
        import torch
        from midlayer.ops import kernels
        PAGE, keep = mmap.PAGESIZE, []
        libc = ctypes.CDLL(None)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

        def at_page_end(t):
            n = t.numel() * t.element_size()
            size = -(-n // PAGE) * PAGE + PAGE
            buf = mmap.mmap(-1, size)
            base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            assert libc.mprotect(base + size - PAGE, PAGE, 0) == 0  # the page after the tensor: no access
            out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=size - PAGE - n).view(t.shape)
            out.copy_(t)
            keep.append(buf)
            return out

        g = torch.Generator().manual_seed(0)
        for N in (8, 40, 101):
            w, x = torch.randn(N, 64, generator=g), torch.randn(9, 64, generator=g)
            p, s = (at_page_end(t) for t in kernels.quantize_q4_1(w))
            c, d = (at_page_end(t) for t in kernels.quantize_q8_0(w))
            out = {}
            for level in kernels.simd_levels():
                kernels.set_simd(level)
                out[level] = [(kernels.gemm_q4_1(x[:M], p, s, N), kernels.gemm_q8_0(x[:M], c, d, N))
                              for M in (1, 8, 9)]
            for level in out:
                for (a4, a8), (b4, b8) in zip(out[0], out[level]):
                    assert torch.equal(a4, b4) and torch.equal(a8, b8), (N, level)
            # the fp32 linear: its weight and its last row end at the page (K = 70: a K tail of 6 lanes)
            wf, xf = at_page_end(torch.randn(N, 70, generator=g)), at_page_end(torch.randn(9, 70, generator=g))
            bf, bx = at_page_end(wf.to(torch.bfloat16)), at_page_end(xf.to(torch.bfloat16))
            lin = {}
            for level in kernels.simd_levels():
                kernels.set_simd(level)
                lin[level] = (kernels.linear_rows(xf, wf), kernels.linear_rows(bx, bf))
            assert all(torch.equal(lin[0][i], y[i]) for y in lin.values() for i in (0, 1)), N
        print("ok")
    """)
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0 and res.stdout.strip() == "ok", (res.returncode, res.stderr[-2000:])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their bit patterns (torch.equal calls -0 and +0 equal and NaN unequal to itself)."""
    return t.contiguous().view(torch.int32)


def _fma_by_hand(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fma(a, b, c) of finite fp32: a b + c exactly (fractions), then the nearest fp32, a tie to the even one."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.uint32)) & 1))


def _lane_order_by_hand(x: np.ndarray, w: np.ndarray, fused: bool = True) -> np.ndarray:
    """The fp32 linear's formula (qkernels.c) one scalar at a time in numpy float32: lane j sums x[k] w[k] for
    k = j, j + 16, ... in order, each a fused multiply-add (`fused`; else a rounded product, then a rounded
    sum), then s_j = L_j + L_(j+8) and ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))."""
    y = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for m in range(x.shape[0]):
        for n in range(w.shape[0]):
            lanes = [np.float32(0)] * 16
            for k in range(x.shape[1]):
                lanes[k % 16] = (_fma_by_hand(x[m, k], w[n, k], lanes[k % 16]) if fused else
                                 np.float32(lanes[k % 16] + np.float32(x[m, k] * w[n, k])))
            s = [np.float32(lanes[j] + lanes[j + 8]) for j in range(8)]
            y[m, n] = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_is_its_formula_at_every_simd_level(dtype):
    """The fp32 and bf16 linear (csrc/qkernels.c) equals its formula computed by hand, and its PyTorch reference,
    bit for bit, at every SIMD level, each level running its own tiles (`qk_linear_tiles`: scalar, AVX2's
    2 x 2, AVX-512F's 4 x 4): 1..9 rows (a last row tile of 1..3), N = 1, 7, 33 (a last output tile of 1..3),
    K with and without a tail of 16 lanes. bf16 operands are widened to fp32 and the fp32 result rounded to
    bf16 once. The special values pass through as IEEE arithmetic gives them: a NaN, an inf against a zero
    weight (NaN) and a row of -0.0 (sums of -0.0 and +0.0 products: +0.0)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 37, generator=g).to(dtype), torch.randn(3, 37, generator=g).to(dtype)
    hand = torch.from_numpy(_lane_order_by_hand(x.float().numpy(), w.float().numpy()))
    assert torch.equal(_bits(kernels.linear_rows_reference(x, w)), _bits(hand))
    assert not torch.equal(hand, (x.double() @ w.double().T).float())  # (another order: the test can tell)
    if dtype == torch.float32:  # (a bf16 product is exact in fp32: fused or not, the same sums)
        assert not torch.equal(hand, torch.from_numpy(_lane_order_by_hand(x.numpy(), w.numpy(), fused=False)))
    assert torch.equal(kernels.linear_rows(x, w), hand.to(dtype))
    b = torch.randn(3, generator=g).to(dtype)  # the bias joins the fp32 sum, rounded to the dtype once
    assert torch.equal(kernels.linear_rows(x, w, b), (hand + b.float()).to(dtype))
    levels = kernels.simd_levels()
    try:
        for K in (5, 16, 37, 70):
            x, w = torch.randn(9, K, generator=g), torch.randn(33, K, generator=g)
            x[2, 1], x[3, 0], x[4] = float("nan"), float("inf"), -0.0
            w[:, 0] = torch.where(torch.arange(33) % 2 == 0, 0.0, w[:, 0])
            x, w = x.to(dtype), w.to(dtype)
            for level in levels:
                kernels.set_simd(level)
                assert kernels.library().qk_linear_tiles() == min(level, 2) * 0x101
                for M in range(1, 10):
                    for N in (1, 7, 33):
                        got = kernels.linear_rows(x[:M], w[:N])
                        want = kernels.linear_rows_reference(x[:M], w[:N])
                        assert got.dtype == dtype and torch.equal(_bits(got.float()), _bits(want.to(dtype).float()))
    finally:
        kernels.set_simd(True)
    assert torch.isnan(want[2]).all() and torch.isnan(want[3, ::2]).all() and (_bits(want[4]) == 0).all()


def test_the_fma_reference_rounds_once_where_fp64_would_round_twice():
    """`fma_reference` (the C linear's fmaf / vfmadd in PyTorch) against the exact sum: a b + c = 1 + 2^-23 +
    2^-24 - 2^-54, just below the tie between 1 + 2^-23 and 1 + 2^-22. Its fp64 sum is the tie itself, which
    rounds to the even 1 + 2^-22; fma rounds the exact sum once, to 1 + 2^-23. A rounded product then a rounded
    sum gives 1 + 2^-22 too. The C linear at every SIMD level (K = 17: lane 0 sums c * 1, then a * b) gives
    fma's, as does its reference; and random values (subnormal products among them) give the hand formula's
    bits."""
    a, b, c = (torch.tensor([v], dtype=torch.float32) for v in (2.0 ** -24 * (1 + 2.0 ** -15), 1 - 2.0 ** -15,
                                                                  1 + 2.0 ** -23))
    assert float((a.double() * b.double() + c.double()).float()) == 1 + 2.0 ** -22  # (the double rounding)
    assert float(c + a * b) == 1 + 2.0 ** -22  # (unfused)
    assert float(kernels.fma_reference(a, b, c)) == 1 + 2.0 ** -23
    x, w = torch.zeros(1, 17), torch.zeros(1, 17)
    x[0, 0], w[0, 0], x[0, 16], w[0, 16] = c, 1.0, a, b
    assert float(kernels.linear_rows_reference(x, w)) == 1 + 2.0 ** -23
    try:
        for level in kernels.simd_levels():
            kernels.set_simd(level)
            assert float(kernels.linear_rows(x, w)) == 1 + 2.0 ** -23, level
    finally:
        kernels.set_simd(True)
    g = torch.Generator().manual_seed(9)
    a, b, c = (torch.randn(300, generator=g) * torch.logspace(-18, 18, 300)[torch.randperm(300, generator=g)]
               for _ in range(3))
    a[:20] = 2.0 ** -140  # subnormal products and sums
    want = [_fma_by_hand(*(np.float32(t[i]) for t in (a, b, c))) for i in range(300)]
    assert torch.equal(_bits(kernels.fma_reference(a, b, c)), _bits(torch.tensor(np.array(want))))


def test_linear_rows_gives_a_row_its_bits_whatever_shares_the_call(monkeypatch):
    """A row's outputs are the same bits alone, among 1..20 rows at any place, in a 3-D batch, from strided
    activations and a transposed weight (copied), with a bias added after; and they are the product within
    fp32's rounding. All of it in C (the slow reference is never called). Under torch.compile(fullgraph=True)
    the kernel is a custom op: the same bits, no graph break. Shapes that do not fit are refused with a
    message."""
    monkeypatch.setattr(kernels, "linear_rows_reference", lambda *a: pytest.fail("the reference ran, not the kernel"))
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(20, 70, generator=g), torch.randn(40, 70, generator=g), torch.randn(40, generator=g)
    full = kernels.linear_rows(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    assert float((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    for i in (0, 7, 19):
        assert torch.equal(kernels.linear_rows(x[i:i + 1], w, b), full[i:i + 1])
        for M in (2, 5, 9):
            rows = torch.randn(M, 70, generator=g)
            at = int(torch.randint(M, (1,), generator=g))
            rows[at] = x[i]
            assert torch.equal(kernels.linear_rows(rows, w, b)[at], full[i])
    wide = torch.randn(20, 96, generator=g)
    wide[:, :70] = x
    assert torch.equal(kernels.linear_rows(wide[:, :70], w, b), full)  # rows at stride 96
    assert torch.equal(kernels.linear_rows(x.view(4, 5, 70), w.T.contiguous().T, b), full.view(4, 5, 40))
    traced = torch.compile(kernels.linear_rows, backend="eager", fullgraph=True)
    assert torch.equal(traced(x, w, b), full) and torch.equal(traced(x[:3], w, b), full[:3])
    with pytest.raises(ValueError, match="want weight"):
        kernels.linear_rows(x, w[:, :69])
    with pytest.raises(ValueError, match="bias"):
        kernels.linear_rows(x, w, b[:39])
    with pytest.raises(ValueError, match="one dtype"):
        kernels.linear_rows(x, w.to(torch.bfloat16))


def _weights(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(17, K, generator=g) * 2
    x[3, 5] = 400.0  # an outlier: its group's scale is large, the other groups' are not
    x[4] = 0.0  # an all-zero row: scale 0
    x[6, :32] *= 1e-38  # a group whose scale is subnormal (1 / d overflowed: -128 codes on AVX2, NaN in torch)
    x[7, 32:64] *= 1e-36  # one whose scale is just normal: its codes as any group's
    return w, x


@pytest.mark.parametrize("M", [1, 2, 5, 8, 13, 17])
def test_gemms_equal_their_reference_bit_for_bit(simd, M):
    w, x = _weights(40, 96)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    assert torch.equal(kernels.gemm_q4_1(x[:M], packed, scales), kernels.gemm_q4_1_reference(x[:M], packed, scales))
    assert torch.equal(kernels.gemm_q8_0(x[:M], codes, d), kernels.gemm_q8_0_reference(x[:M], codes, d))
    q, dq, sq = kernels.quantize_q8(x[:M])
    rq, rdq, rsq = kernels.quantize_q8_reference(x[:M])
    assert torch.equal(q, rq) and torch.equal(dq, rdq) and torch.equal(sq, rsq)
    if M >= 8:
        assert int(q[6, :32].abs().sum()) == 0 and int(q[7, 32:64].abs().max()) == 127


def test_quantisation_hand_example():
    """One group of 32: d = amax/127, q = round(x/d) (half to even), s = d * sum(q)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 2.54, -1.0, 0.01  # d = 0.02: q = 127, -50, round(0.5) = 0 (half to even)
    q, d, s = kernels.quantize_q8(x)
    assert float(d) == pytest.approx(0.02)
    assert q[0, :3].tolist() == [127, -50, 0] and int(q[0, 3:].abs().sum()) == 0
    assert float(s) == pytest.approx(0.02 * 77)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_makes_its_outputs_nan_at_every_simd_level(bad):
    """A group holding a NaN or an infinity has codes 0 and d = s = NaN, at every SIMD level and in the
    reference: every output it feeds is NaN, as a float GEMM's is. (The kernels turned a NaN into a code, -128
    on AVX2 and INT_MIN in the scalar sum, and returned finite outputs near 1e8.) The other rows are untouched."""
    if not kernels.available():
        pytest.skip("no C compiler: the kernels are not built")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 64, generator=g), torch.randn(3, 64, generator=g)
    x[1, 9] = bad
    p4, s4 = kernels.quantize_q4_1(w)
    ref = kernels.quantize_q8_reference(x)
    assert ref[0][1, :32].abs().sum() == 0 and ref[1][1, 0].isnan() and ref[2][1, 0].isnan()
    assert not ref[1][1, 1].isnan() and not ref[1][[0, 2]].isnan().any()
    want = kernels.gemm_q4_1_reference(x, p4, s4, 8)
    assert want[1].isnan().all() and not want[[0, 2]].isnan().any()
    try:
        for level in kernels.simd_levels():
            kernels.set_simd(level)
            got = kernels.quantize_q8(x)
            for a, b in zip(got, ref):
                assert torch.equal(a, b) if a.dtype == torch.int8 else torch.equal(a.isnan(), b.isnan()) and \
                    torch.equal(a.nan_to_num(), b.nan_to_num())
            y = kernels.gemm_q4_1(x, p4, s4, 8)
            assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.nan_to_num(), want.nan_to_num())
    finally:
        kernels.set_simd(True)


def test_gemm_rows_are_invariant(simd):
    """Row 0 computed alone, or among 2..17 rows: the same bits (exact int32 block sums, per-row order)."""
    w, x = _weights(200, 128, seed=1)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    alone4, alone8 = kernels.gemm_q4_1(x[:1], packed, scales), kernels.gemm_q8_0(x[:1], codes, d)
    for m in range(2, 18):
        assert torch.equal(kernels.gemm_q4_1(x[:m], packed, scales)[:1], alone4)
        assert torch.equal(kernels.gemm_q8_0(x[:m], codes, d)[:1], alone8)


@pytest.mark.parametrize("N", [1, 3, 13, 45])
def test_gemms_with_outputs_not_a_multiple_of_8(simd, N):
    """The layouts pad N up to a multiple of 8 with zero weights; the padded outputs are never written, and
    the real ones equal the reference and the dense product of the dequantised weight's rows."""
    w, x = _weights(N, 64, seed=7)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    assert packed.shape == (-(-N // 8), 2, 128) and scales.shape == (-(-N // 8), 2, 2, 8)
    assert codes.shape == (-(-N // 8), 2, 256) and d.shape == (-(-N // 8), 2, 8)
    assert kernels.dequantize_q4_1(packed, scales, N).shape == (N, 64)
    full4 = kernels.gemm_q4_1_reference(x, packed, scales)  # all 8 * groups outputs, the padding gives 0
    full8 = kernels.gemm_q8_0_reference(x, codes, d)
    assert float(full4[:, N:].abs().sum()) == 0.0 and float(full8[:, N:].abs().sum()) == 0.0
    for M in (1, 2, 4, 7):
        y4, y8 = kernels.gemm_q4_1(x[:M], packed, scales, N), kernels.gemm_q8_0(x[:M], codes, d, N)
        assert y4.shape == y8.shape == (M, N)
        assert torch.equal(y4, kernels.gemm_q4_1_reference(x[:M], packed, scales, N))
        assert torch.equal(y8, kernels.gemm_q8_0_reference(x[:M], codes, d, N))
        assert torch.equal(y4, full4[:M, :N]) and torch.equal(y8, full8[:M, :N])
    with pytest.raises(ValueError):
        kernels.gemm_q4_1(x[:1], packed, scales, N + 8)


def test_odd_row_counts_equal_single_rows(simd):
    """7 rows run as tiles of 4 + 2 + 1 (and 5 = 4 + 1, 3 = 2 + 1): every row equals its one-row result."""
    w, x = _weights(77, 160, seed=8)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    for M in (7, 5, 3):
        y4, y8 = kernels.gemm_q4_1(x[:M], packed, scales, 77), kernels.gemm_q8_0(x[:M], codes, d, 77)
        for m in range(M):
            assert torch.equal(y4[m:m + 1], kernels.gemm_q4_1(x[m:m + 1], packed, scales, 77)), (M, m)
            assert torch.equal(y8[m:m + 1], kernels.gemm_q8_0(x[m:m + 1], codes, d, 77)), (M, m)


def test_gemms_avx2_equal_scalar():
    w, x = _weights(101, 256, seed=9)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    fast = [(kernels.gemm_q4_1(x[:M], packed, scales, 101), kernels.gemm_q8_0(x[:M], codes, d, 101))
            for M in (1, 2, 3, 4, 8, 9)]
    kernels.set_simd(False)
    try:
        slow = [(kernels.gemm_q4_1(x[:M], packed, scales, 101), kernels.gemm_q8_0(x[:M], codes, d, 101))
                for M in (1, 2, 3, 4, 8, 9)]
    finally:
        kernels.set_simd(True)
    for (f4, f8), (s4, s8) in zip(fast, slow):
        assert torch.equal(f4, s4) and torch.equal(f8, s8)


def test_canonical_order_by_hand(simd):
    """One output of one row, step by step in fp32 as the C header documents: isum_g exact, then
    acc <- (acc + (d_w d_x) isum) + m_w s_x (Q4_1) or acc <- acc + (d_w d_x) isum (Q8_0), g in order."""
    w, x = _weights(11, 96, seed=10)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d8 = kernels.quantize_q8_0(w)
    qx, dx, sx = kernels.quantize_q8(x[3:4])
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    for n in (0, 5, 10):
        qw = kernels.unpack_q4_1(packed, 11)[n].long()
        s = scales.float()[n // 8, :, :, n % 8]  # [G, (d, m)]
        c8 = kernels.unpack_q8_0(codes, 11)[n].long()
        acc4, acc8 = f32(0.0), f32(0.0)
        for g in range(3):
            a = qx[0, 32 * g:32 * g + 32].long()
            isum4, isum8 = f32(float(int((qw[g] * a).sum()))), f32(float(int((c8[g] * a).sum())))
            acc4 = (acc4 + (s[g, 0] * dx[0, g]) * isum4) + s[g, 1] * sx[0, g]
            acc8 = acc8 + (d8.float()[n // 8, g, n % 8] * dx[0, g]) * isum8
        assert torch.equal(kernels.gemm_q4_1(x[3:4], packed, scales, 11)[0, n], acc4)
        assert torch.equal(kernels.gemm_q8_0(x[3:4], codes, d8, 11)[0, n], acc8)


def test_interleaved_layout():
    """Q4_1: byte 32 v + 4 j + i of (group, block) holds element 4v + i of output j (low nibble) and element
    16 + 4v + i (high nibble); Q8_0: byte 32 c + 4 j + i holds element 4c + i of output j."""
    q = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(11))
    q[:, ::32], q[:, 1::32] = 0, 15
    w = q.float() * 0.5 - 1.0  # d = 0.5, m = -1 in every block: codes recovered exactly
    packed, scales = kernels.quantize_q4_1(w)
    n, g, e = 13, 1, 22  # group 1, output j = 5, block 1, element 22 = 16 + 4 * 1 + 2: high nibble
    assert int(packed[1, g, 32 * 1 + 4 * 5 + 2]) >> 4 == int(q[n, 32 * g + e])
    assert int(packed[1, g, 32 * 1 + 4 * 5 + 2]) & 15 == int(q[n, 32 * g + 6])
    assert float(scales[1, g, 0, 5]) == 0.5 and float(scales[1, g, 1, 5]) == -1.0
    c = torch.randint(-127, 128, (16, 64), generator=torch.Generator().manual_seed(12))
    c[:, 0] = 127
    codes, d = kernels.quantize_q8_0(c.float() * 0.25)
    assert int(codes[1, g, 32 * (e // 4) + 4 * 5 + e % 4]) == int(c[n, 32 * g + e])


def test_quantisers_recover_file_codes_and_approximate_the_matmul():
    """Weights that are exactly d q + m (fp16 d, m: a Q4_1 file) requantise to the same codes; the kernel's
    result is the dense matmul of the represented weight up to the Q8 activation rounding."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (64, 4, 32), generator=g)
    q[:, :, 0], q[:, :, 1] = 0, 15  # Q4_1 blocks span their full code range
    d = (torch.rand(64, 4, generator=g) * 0.01 + 1e-3).half()
    m = (-torch.rand(64, 4, generator=g) * 0.05).half()
    w = (d.float()[..., None] * q + m.float()[..., None]).reshape(64, 128)
    packed, scales = kernels.quantize_q4_1(w)
    assert torch.equal(kernels.unpack_q4_1(packed).long(), q)
    assert torch.equal(kernels.dequantize_q4_1(packed, scales), w)
    c8 = torch.randint(-127, 128, (64, 4, 32), generator=g)
    c8[:, :, 0] = 127
    w8 = (d.float()[..., None] * c8).reshape(64, 128)
    codes, d8 = kernels.quantize_q8_0(w8)
    assert torch.equal(kernels.unpack_q8_0(codes).long(), c8) and torch.equal(kernels.dequantize_q8_0(codes, d8), w8)
    x = torch.randn(5, 128, generator=g)
    for y, ref in ((kernels.gemm_q4_1(x, packed, scales), x @ w.t()), (kernels.gemm_q8_0(x, codes, d8), x @ w8.t())):
        assert float((y - ref).norm() / ref.norm()) < 0.02


def _attention_inputs(T: int, S: int, seed: int = 0, D: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 6, T, D, generator=g)
    k = torch.randn(1, 2, S, D, generator=g)
    v = torch.randn(1, 2, S, D, generator=g)
    mask = torch.zeros(1, 1, T, S)
    for t in range(T):  # causal over the last T slots, plus one hidden context key (a skipped token)
        mask[0, 0, t, S - T + t + 1:] = float("-inf")
    mask[..., 3] = float("-inf")
    mask[..., 5] = -1.5  # a gated key: ln g
    return q, k, v, mask


def test_attention_matches_reference_and_rows_are_invariant(simd):
    q, k, v, mask = _attention_inputs(12, 40)
    out = kernels.attention(q, k, v, mask)
    torch.testing.assert_close(out, kernels.attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-6)
    for T in range(1, 13):  # the first row among T rows
        assert torch.equal(kernels.attention(q[:, :, :T], k, v, mask[:, :, :T])[:, :, :1], out[:, :, :1])
    # a decode step: the same row over only the keys that exist then, with an all-visible (None) mask
    S0 = 40 - 12 + 1
    alone = kernels.attention(q[:, :, :1], k[:, :, :S0], v[:, :, :S0], mask[:, :, :1, :S0])
    assert torch.equal(alone, out[:, :, :1])


@pytest.mark.parametrize("D", [16, 20, 64, 80])
def test_attention_depends_on_the_keys_seen_not_on_their_slots(simd, D):
    """A draft-tree node sees the context and its ancestors, with its siblings' rows masked in between; plain
    decoding sees the same keys side by side. Both must give the same bits, or tree verification is not
    lossless (q4 EAGLE-2 trees gave other text than plain greedy on 6 of 8 prompts before the kernel summed
    over the visible keys only)."""
    g = torch.Generator().manual_seed(7)
    S = 45
    q = torch.randn(1, 6, 1, D, generator=g)
    k, v = torch.randn(1, 2, S, D, generator=g), torch.randn(1, 2, S, D, generator=g)
    hidden = [3, 17, 18, 30, 41, 42]  # holes across several 8-key lanes, and at the end
    mask = torch.zeros(1, 1, 1, S)
    mask[..., hidden] = float("-inf")
    mask[..., 9] = -2.0  # a gated key keeps its finite bias
    seen = [s for s in range(S) if s not in hidden]
    interleaved = kernels.attention(q, k, v, mask)
    packed = kernels.attention(q, k[:, :, seen], v[:, :, seen], mask[..., seen])
    assert torch.equal(interleaved, packed)
    no_mask = kernels.attention(q, k[:, :, seen], v[:, :, seen], None)  # plain decoding's call: mask None
    packed_zero = kernels.attention(q, k[:, :, seen], v[:, :, seen], torch.zeros(1, 1, 1, len(seen)))
    assert torch.equal(no_mask, packed_zero)
    torch.testing.assert_close(interleaved, kernels.attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-6)


def _scalar_attention(q, k, v, mask):
    """kernels.attention on the portable scalar path (the SIMD level restored after)."""
    kernels.set_simd(False)
    try:
        return kernels.attention(q, k, v, mask)
    finally:
        kernels.set_simd(True)


# the AVX2 path takes 64 columns at a time, then 8; a head width not a multiple of 8 (20) takes the scalar path
@pytest.mark.parametrize("D", [16, 20, 64, 80])
def test_attention_avx2_equals_scalar(D):
    q, k, v, mask = _attention_inputs(5, 70, seed=3, D=D)
    fast = kernels.attention(q, k, v, mask)
    torch.testing.assert_close(fast, kernels.attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert torch.equal(fast, _scalar_attention(q, k, v, mask))


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["kv32", "kv16"])
@pytest.mark.parametrize("rep,D", [(2, 64), (3, 64), (3, 80), (4, 16), (4, 256), (2, 20)])  # 256: 2 per item
def test_ragged_batch_attention_equals_scalar_and_each_row_alone(rep, D, kv):
    """A continuous batch's decode step: 16 sequences of different lengths read up to the longest one's
    length, their unused slots masked -inf (the AVX2 path skips whole masked 4-key blocks). Each sequence alone
    must get the bits it gets in the batch, and the AVX2 path the portable scalar path's, over fp32 and fp16
    caches. Also a finite gated bias and a weight that underflows to exactly 0 (skipped, as the scalar loop
    skips it)."""
    g = torch.Generator().manual_seed(rep * 100 + D)
    B, Hk, S = 16, 2, 50
    H = rep * Hk
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hk, S, D, generator=g).to(kv), torch.randn(B, Hk, S, D, generator=g).to(kv)
    mask = torch.zeros(B, 1, 1, S)
    for b in range(B):
        mask[b, ..., 3 + 3 * b:] = float("-inf")  # row b holds 3 + 3b keys
    mask[:, ..., 1] = -2.0     # a gated key
    mask[:, ..., 2] = -200.0   # its weight underflows to 0
    fast = kernels.attention(q, k, v, mask)
    torch.testing.assert_close(fast, kernels.attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-6)
    for b in (0, 5, 15):
        alone = kernels.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1])
        assert torch.equal(alone, fast[b:b + 1])
    assert torch.equal(fast, _scalar_attention(q, k, v, mask))


def test_rmsnorm_and_rope_store_match_pytorch():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(7, 64, generator=g) * 100, torch.rand(64, generator=g)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-5), ref, rtol=1e-6, atol=1e-6)
    B, T, H, Hk, D = 1, 3, 4, 2, 16
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    kc, vc = torch.zeros(B, Hk, 10, D), torch.zeros(B, Hk, 10, D)
    slots = torch.tensor([[4, 5, 7]])
    view = qkv.view(B, T, H + 2 * Hk, D)
    q_ref = apply_rope(view[:, :, :H], cos[:, :, None], sin[:, :, None])
    k_ref = apply_rope(view[:, :, H:H + Hk], cos[:, :, None], sin[:, :, None])
    v_ref = view[:, :, H + Hk:].clone()
    kernels.rope_store(qkv, H, Hk, cos, sin, kc, vc, slots)
    torch.testing.assert_close(view[:, :, :H], q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc[:, :, [4, 5, 7]], k_ref.transpose(1, 2), rtol=1e-6, atol=1e-6)
    assert torch.equal(vc[:, :, [4, 5, 7]], v_ref.transpose(1, 2))
    assert float(kc[:, :, 6].abs().sum()) == 0.0


# Edge values of each 16-bit format for the stores: ties both ways, values below its range (subnormals, underflow
# to +-0), overflow to infinity, signed zeros, a NaN
KV_EDGES = {torch.float16: [0.0, -0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 65504.0, 65520.0, -1e6, 2.0 ** -24,
                            2.0 ** -25, 2.0 ** -25 * 1.5, -(2.0 ** -26), 6.1e-5, 3.0e-5, 1.0e-7, 2.0 ** -14 * 0.999,
                            float("inf"), -float("inf"), float("nan")],
            torch.bfloat16: [0.0, -0.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -8 + 2.0 ** -20, 3.3961e38,
                             3.4e38, -3.4e38, float("inf"), -float("inf"), 1e-40, -1e-41, 9.2e-41,
                             2.0 ** -126 * (1 - 2.0 ** -9), float("nan")]}


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [32, 20])  # 20: rows that end in a tail shorter than F16C's 8 lanes
@pytest.mark.parametrize("level", [0, 1, -1], ids=["scalar", "avx2", "best"])
def test_a_16_bit_kv_cache_stores_torchs_rounding_and_attends_over_the_widened_values(level, D, kv):
    """An fp16 or bf16 KV cache (bf16: a bf16 model's, in the static step's C attention): rope_store rounds K and V
    to nearest even, as torch's .half() and .to(torch.bfloat16) do (KV_EDGES), and keeps a NaN a NaN, at every
    SIMD level (the scalar converters and F16C's); attention over it gives the bits of fp32 attention over the
    same values widened."""
    kernels.set_simd(level)
    try:
        g = torch.Generator().manual_seed(11)
        B, T, H, Hk = 2, 4, 4, 2
        qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g)
        edge = torch.tensor(KV_EDGES[kv])
        vals = torch.randn(B * T * Hk * D, generator=g) * torch.logspace(-9, 5, B * T * Hk * D)
        vals[:len(edge)] = edge
        qkv.view(B, T, H + 2 * Hk, D)[:, :, H + Hk:] = vals.view(B, T, Hk, D)  # V is stored as it is: rounded
        cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
        k32, v32 = torch.zeros(B, Hk, 9, D), torch.zeros(B, Hk, 9, D)
        k16, v16 = torch.zeros(B, Hk, 9, D, dtype=kv), torch.zeros(B, Hk, 9, D, dtype=kv)
        slots = torch.tensor([[1, 2, 3, 5], [0, 4, 6, 8]])
        kernels.rope_store(qkv.clone(), H, Hk, cos, sin, k32, v32, slots)
        kernels.rope_store(qkv, H, Hk, cos, sin, k16, v16, slots)
        for got, full in ((v16, v32), (k16, k32)):
            nan = full.isnan()
            assert torch.equal(got.isnan(), nan) and bool(nan.any()) == (full is v32)
            assert torch.equal(got[~nan].view(torch.int16), full[~nan].to(kv).view(torch.int16))  # signed zeros too
        q = torch.randn(B, H, T, D, generator=g)
        mask = torch.zeros(B, 1, T, 9)
        mask[0, ..., 4] = float("-inf")
        mask[1, ..., 7] = -1.5
        kf, vf = k16.float(), torch.randn(B, Hk, 9, D, generator=g).to(kv)  # (K holds no NaN: asserted above)
        got = kernels.attention(q, k16, vf, mask)
        assert torch.equal(got, kernels.attention(q, kf, vf.float(), mask))
        torch.testing.assert_close(got, kernels.attention_reference(q, kf, vf.float(), mask), rtol=1e-5, atol=1e-6)
    finally:
        kernels.set_simd(True)


def test_silu_mul_matches_pytorch_and_its_simd_paths_agree():
    g = torch.Generator().manual_seed(6)
    ab = torch.randn(5, 2 * 44, generator=g) * 6  # 44: 5 vectors of 8 and a scalar tail of 4
    ab[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # the exp's range edges: exp(-90) underflows to 0
    a, b = ab.chunk(2, -1)
    fast = kernels.silu_mul(ab)
    torch.testing.assert_close(fast, torch.nn.functional.silu(a) * b, rtol=1e-6, atol=1e-7)
    assert float(fast[0, 3]) == 0.0 and torch.equal(fast[0, 2], ab[0, 2] * b[0, 2])  # silu(90) = 90 exactly
    kernels.set_simd(False)
    try:
        assert torch.equal(kernels.silu_mul(ab), fast)
    finally:
        kernels.set_simd(True)
    assert kernels.silu_mul(ab.requires_grad_()) is None  # training keeps PyTorch's (differentiable) silu


def _q4(seed: int = 0, **over):
    return compress_weights(make_tiny(DIMS, gating=False, seed=seed, **over), "q4")


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["kv32", "kv16"])
@pytest.mark.parametrize("placement", ["sandwich", "pre"])
def test_fused_block_equals_the_block_module_by_module(simd, placement, kv):
    """A q4 block over the KV cache runs as ONE C call (kernels.block_q4), and a forward's dense q4 blocks all
    in one (kernels.blocks_q4): outputs and the K/V written are the bits of the module-by-module path
    (Block.forward with `fused_q4` None) -- prefill, a decode step, a tree verification with its mask, and two
    left-padded prompts (batch 2, inactive pad rows: block by block)."""
    import copy

    fused = _q4(seed=2, norm_placement=placement)
    assert all(b.fused_q4 is not None for b in fused.layers)
    ref = copy.deepcopy(fused)  # the copy's fused calls would read the copy's own weights (addresses per call)
    for b in ref.layers:
        b.fused_q4 = None
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, V, (2, 20), generator=g)
    tree = DraftTree([(0,), (1,), (0, 0), (1, 0)])

    def run(model):
        out = []
        cache = KVCache.for_model(model.cfg, 1, 40, dtype=kv)
        out.append(forward_cached(model, ids[:1, :12], cache, torch.arange(12)[None]))
        cap = {1: None, 3: None}  # a captured middle layer (drafters read them) splits the stacked call
        out.append(forward_cached(model, ids[:1, 12:13], cache, torch.tensor([[12]]), capture=cap))
        out += [cap[1], cap[3]]
        # two rows joining at block 1 (hidden transfer's pseudo rows), then the step is undone
        joins = JoinedRows(at={1: lambda h: torch.cat([h[:, -1:] * 0.5, h[:, -1:] * -0.25], 1)}, count=2)
        out.append(forward_cached(model, ids[:1, 13:14], cache, torch.tensor([[13, 14, 15]]), joins=joins))
        cache.truncate(13)
        L = cache.length
        out.append(forward_cached(model, ids[:1, 13:18], cache, torch.tensor([[L, L + 1, L + 1, L + 2, L + 2]]),
                                  extra_mask=tree.verify_mask(L)))
        out += [cache.k[:, :, :, :cache.length].clone(), cache.v[:, :, :, :cache.length].clone(),
                cache.bias[:, :, :cache.length].clone()]
        batch = KVCache.for_model(model.cfg, 2, 40, dtype=kv)
        active = torch.ones(2, 10, dtype=torch.bool)
        active[1, :3] = False  # the second prompt is 3 tokens shorter: left padding
        pos = (torch.arange(10)[None] - torch.tensor([[0], [3]])).clamp_min(0)
        out.append(forward_cached(model, ids[:, :10], batch, pos, active=active))
        out.append(batch.k[:, 1, :, 3:10].clone())
        return out

    from midlayer.engine.generate import CachedStep

    calls: list[str] = []
    real_one, real_stack, real_run = kernels.block_q4, kernels.blocks_q4, CachedStep.run_fused
    kernels.block_q4 = lambda *a, **k: calls.append("block") or real_one(*a, **k)
    kernels.blocks_q4 = lambda *a, **k: calls.append("stack") or real_stack(*a, **k)
    try:
        with torch.inference_mode():
            stacked = run(fused)  # the dense forwards: all blocks in one C call (kernels.blocks_q4)
            n_stacked = list(calls)
            calls.clear()
            CachedStep.run_fused = lambda *a: None  # block by block: one C call each (kernels.block_q4)
            one_by_one = run(fused)
            n_one = list(calls)
            calls.clear()
            modules = run(ref)
    finally:
        kernels.block_q4, kernels.blocks_q4, CachedStep.run_fused = real_one, real_stack, real_run
    for a, b, c in zip(stacked, one_by_one, modules):
        assert torch.equal(a, b) and torch.equal(b, c)
    L = DIMS["n_layers"]
    # prefill; decode with layer 1 captured: block 0 alone, then 1..L-1; rows joining at block 1: the same;
    # verification; the padded batch (it has inactive rows): block by block
    assert n_stacked == ["stack", "block", "stack", "block", "stack", "stack"] + ["block"] * L
    assert n_one == ["block"] * 5 * L and calls == []  # 5 forwards of L blocks; the module path: no C block


def test_q4_model_rows_bit_identical_decode_verify_prefill():
    """A row's logits, and the K/V it writes, are the same bits whether it is decoded alone, verified among
    1..16 rows, or part of a prefill chunk (SPEC section 9, batch invariance)."""
    model = _q4()
    assert model.batch_invariant
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(5))
    ctx = 12

    def run(T: int):
        cache = KVCache.for_model(model.cfg, 1, 40)
        forward_cached(model, ids[:, :ctx], cache, torch.arange(ctx)[None])
        logits = forward_cached(model, ids[:, ctx:ctx + T], cache, torch.arange(ctx, ctx + T)[None])
        return logits[0, 0], cache.k[:, :, :, ctx].clone(), cache.v[:, :, :, ctx].clone()

    alone = run(1)
    for T in range(2, 17):
        rows = run(T)
        assert all(torch.equal(a, b) for a, b in zip(alone, rows)), T
    # prefill chunk: the same row as the last of a 13-token prefill
    cache = KVCache.for_model(model.cfg, 1, 40)
    pre = forward_cached(model, ids[:, :ctx + 1], cache, torch.arange(ctx + 1)[None])
    assert torch.equal(pre[0, ctx], alone[0])


def test_q4_tree_node_logits_equal_plain_decoding_bit_for_bit():
    """Node (1, 0) of a tree is verified at slot p + 4 with its sibling rows (0,), (0, 0) masked in between;
    plain decoding computes the same token at slot p + 2 with its parent beside it. Same bits, else an
    accepted non-first branch can flip a near-tie (q4 EAGLE-2 trees on SmolLM2 did, on 6 of 8 prompts)."""
    model = _q4(seed=3)
    ids = torch.randint(0, V, (1, 14), generator=torch.Generator().manual_seed(8))
    ctx = 11  # tokens 0..10 in the cache; token 11 the root, then the accepted branch: tokens 12, 13
    tree = DraftTree([(0,), (1,), (0, 0), (1, 0)])  # breadth-first: (0,) (1,) (0, 0) (1, 0)
    wrong = (int(ids[0, 12]) + 1) % V
    nodes = torch.tensor([[wrong, int(ids[0, 12]), wrong, int(ids[0, 13])]])
    cache = KVCache.for_model(model.cfg, 1, 40)
    forward_cached(model, ids[:, :ctx], cache, torch.arange(ctx)[None])
    start = cache.length
    verify = forward_cached(model, torch.cat([ids[:, ctx:ctx + 1], nodes], 1), cache,
                            (ctx + torch.tensor([0, 1, 1, 2, 2]))[None], extra_mask=tree.verify_mask(start, "cpu"))
    cache = KVCache.for_model(model.cfg, 1, 40)
    forward_cached(model, ids[:, :ctx], cache, torch.arange(ctx)[None])
    plain = [forward_cached(model, ids[:, t:t + 1], cache, torch.tensor([[t]]))[0, 0] for t in range(ctx, ctx + 3)]
    assert torch.equal(verify[0, 0], plain[0])  # the root
    assert torch.equal(verify[0, 2], plain[1])  # node (1,): its parent is the root
    assert torch.equal(verify[0, 4], plain[2])  # node (1, 0): two siblings' rows masked between it and its path


@pytest.mark.parametrize("tree", [DraftTree.chain(3), DraftTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])],
                         ids=["chain3", "tree5"])
def test_q4_speculative_output_equals_plain_greedy(tree):
    """Lossless in q4 by exact token equality, for a wrong drafter (every draft rejected: the bonus token
    comes from a multi-row forward) and a perfect one (long acceptances)."""
    model = _q4(seed=1)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        prompt = torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        ref = generate(model, [prompt], GenerationConfig(max_new_tokens=20))[0]
        for drafter in (RandomDrafter(V, seed=2), OracleDrafter(prompt + ref, V)):
            out, _ = speculative_generate(model, prompt, drafter, tree, 20)
            assert out == ref


def test_draft_trained_on_fp32_base_loads_onto_q4_model_and_stays_lossless(tmp_path):
    """A q4 model's head is Q8_0 codes, not an nn.Linear: the draft's base check must still recognise it
    (the LM-head probe reads the dequantised head), and decoding with the draft stays lossless."""
    from midlayer.speculative.medusa import MedusaHeads
    from midlayer.speculative.registry import load_drafter, save_draft

    base = make_tiny(DIMS, gating=False, seed=2)
    heads = MedusaHeads(DIMS["dim"], 2)
    with torch.no_grad():
        for lin in heads.heads:
            lin.weight.normal_(0, 0.1)
    save_draft(tmp_path / "medusa", heads, base=base)
    model = compress_weights(base, "q4")
    drafter, _, _ = load_drafter(tmp_path / "medusa", model)
    prompt = [3, 14, 15, 92, 65, 35]
    ref = generate(model, [prompt], GenerationConfig(max_new_tokens=16))[0]
    assert speculative_generate(model, prompt, drafter, DraftTree.chain(2), 16)[0] == ref


def test_only_q4_is_called_lossless():
    for fmt in ("fp32", "bf16", "int4"):
        assert not compress_weights(make_tiny(DIMS, gating=False), fmt).batch_invariant
    assert not compress_weights(make_tiny(DIMS, gating=False), "q4", head="fp32").batch_invariant


def test_kv_cache_dtype_per_format_and_its_choice():
    """q4 keeps fp16 K/V by default, the other formats their weights' dtype; kv= chooses; the engine's caches
    follow (kv_dtype), and a q4 model with either cache still decodes speculatively as it decodes plainly."""
    from midlayer.model.kv_cache import kv_dtype

    assert compress_weights(make_tiny(DIMS, gating=False), "q4").kv_dtype == torch.float16
    assert kv_dtype(compress_weights(make_tiny(DIMS, gating=False), "fp32")) == torch.float32
    with pytest.raises(ValueError, match="kv must be one of fp32, fp16"):
        compress_weights(make_tiny(DIMS, gating=False), "q4", kv="int8")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    for kv in ("fp32", "fp16"):
        model = compress_weights(make_tiny(DIMS, gating=False), "q4", kv=kv)
        assert kv_dtype(model) == {"fp32": torch.float32, "fp16": torch.float16}[kv]
        plain = generate(model, [prompt], GenerationConfig(max_new_tokens=16))[0]
        for drafter in (OracleDrafter(prompt + plain, V), RandomDrafter(V, seed=3)):  # all accepted; rejected
            spec, _ = speculative_generate(model, prompt, drafter, DraftTree([(0,), (1,), (0, 0), (0, 0, 0)]), 16)
            assert spec == plain


def _topk_at_every_level(x: torch.Tensor, k: int) -> dict:
    """kernels.topk(x, k, with_lse=True) at each SIMD level the machine has (the best one restored after)."""
    out = {}
    try:
        for level in kernels.simd_levels():
            kernels.set_simd(level)
            out[level] = kernels.topk(x, k, with_lse=True)
    finally:
        kernels.set_simd(True)
    return out


def test_topk_and_argmax_match_torch_with_ties_nan_and_every_simd_level():
    """kernels.topk: the k largest per row, largest first, equal values in index order (torch.argmax's first
    maximum), NaN above every number; lse = logsumexp per row. The same bits at every SIMD level (only the
    chunk skipping differs), torch.topk's values and indices where values are distinct."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1000, generator=g)
    x[1, 17] = x[1, 500] = 9.0  # a tie for the maximum: the first index wins
    x[2, 40] = float("nan")  # NaN ranks first, as in torch
    x[3] = float("-inf")
    x[3, 999] = 0.0
    x[4, 3:900:7] = 5.0  # many equal values: index order
    out = _topk_at_every_level(x, 6)
    vals, idx, lse = out[0]
    for level, (v, i, l) in out.items():
        assert torch.equal(i, idx) and torch.equal(v.nan_to_num(), vals.nan_to_num()) and torch.equal(l.nan_to_num(), lse.nan_to_num()), level
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    assert idx[1, :2].tolist() == [17, 500] and idx[2, 0] == 40 and idx[3, 0] == 999
    assert idx[4].tolist() == list(range(3, 3 + 6 * 7, 7))
    tv, ti = x[0].topk(6)
    assert torch.equal(vals[0], tv) and torch.equal(idx[0], ti)
    finite = torch.tensor([0, 1, 3, 4])
    assert torch.allclose(lse[finite], torch.logsumexp(x[finite], -1), atol=1e-5) and torch.isnan(lse[2])
    assert kernels.topk(x, 1001) is None and kernels.topk(x.double(), 2) is None and kernels.topk(x, 0) is None
    assert torch.equal(kernels.argmax(x.double()), x.double().argmax(-1))  # the torch fallback


def test_topk_lse_over_a_row_length_not_a_multiple_of_8():
    """The SIMD logsumexp runs 8 lanes, then a scalar tail: 1003 logits whose maximum (20) is in that tail, a
    row holding +inf (lse +inf, not NaN: exp(x - max) is NaN there), and a plain row: torch's logsumexp, and the
    same bits at every SIMD level."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1003, generator=g)
    x[0, 1002] = 20.0
    x[1, 1000] = float("inf")
    out = _topk_at_every_level(x, 4)
    vals, idx, lse = out[0]
    for v, i, lv in out.values():
        assert torch.equal(i, idx) and torch.equal(v, vals) and torch.equal(lv, lse)
    torch.testing.assert_close(lse[[0, 2]], torch.logsumexp(x[[0, 2]], -1), rtol=1e-6, atol=1e-5)
    assert lse[1] == float("inf") and idx[0, 0] == 1002 and idx[1, 0] == 1000


def test_two_threads_get_their_own_results_and_build_the_library_once(tmp_path):
    """Threads calling the kernels at once: each call's scratch buffer is its thread's (a shared one gave wrong
    results in ~1 call of 4 here), and a first use from two threads builds and loads one library (both wrote
    the same temporary file, and one fell back to PyTorch)."""
    import subprocess
    import sys
    import threading

    if not kernels.available():
        pytest.skip("no C compiler: the kernels are not built")
    g = torch.Generator().manual_seed(1)
    p4, s4 = kernels.quantize_q4_1(torch.randn(64, 256, generator=g))
    xs = [torch.randn(5 + i, 256, generator=g) for i in range(2)]
    want = [kernels.gemm_q4_1(x, p4, s4, 64) for x in xs]
    bad = []

    def run(i: int) -> None:
        for _ in range(300):
            if not torch.equal(kernels.gemm_q4_1(xs[i], p4, s4, 64), want[i]):
                bad.append(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    code = ("import threading, warnings; warnings.simplefilter('error'); import midlayer.ops.kernels as k; "
            "got = []; ts = [threading.Thread(target=lambda: got.append(k.library())) for _ in range(4)]; "
            "[t.start() for t in ts]; [t.join() for t in ts]; "
            "assert len(got) == 4 and got[0] is not None and all(g is got[0] for g in got), got")
    env = {**os.environ, "MIDLAYER_CACHE": str(tmp_path / "cache")}
    run_ = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run_.returncode == 0, run_.stderr
    assert [p.name for p in (tmp_path / "cache").rglob("*.tmp*")] == []  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    built = [p for p in (tmp_path / "cache").rglob("*.so")]
    assert len(built) == 1 and built[0].stat().st_mode & 0o777 == 0o777 & ~umask  # as the compiler makes it


def test_the_portable_build_gives_the_bits_of_this_one(tmp_path, monkeypatch):
    """A CPU other than x86-64 (arm64: Apple silicon, Graviton) compiles the scalar versions alone, which is what
    -DQK_PORTABLE builds here. That build has no SIMD level above 0, and every kernel it holds gives the bits of
    this machine's build at its best level: the GEMMs, the fp32 and bf16 linears, top-k with its logsumexp,
    RMSNorm, SwiGLU, RoPE with the store into fp32 and fp16 caches, attention over both, and a q4 model's
    verification forward (one C call for its blocks) and its tree's logits. (An aarch64 build run under qemu
    gave these bits too: docs/results/decode-cpu.md, 61st session.)"""
    kernels.compile_library(kernels._SRC, tmp_path / "portable.so", portable=True)
    portable, shipped = kernels.open_library(tmp_path / "portable.so"), kernels.library()
    portable.qk_set_simd(3)
    assert portable.qk_simd_level() == 0 and portable.qk_gemm_tiles() == 0 and portable.qk_linear_tiles() == 0
    g = torch.Generator().manual_seed(21)
    w, x = _weights(101, 256, seed=4)
    packed, scales = kernels.quantize_q4_1(w)
    codes, d = kernels.quantize_q8_0(w)
    wf, xf = torch.randn(37, 200, generator=g), torch.randn(9, 200, generator=g)
    logits = torch.randn(5, 300, generator=g)
    logits[1, 7] = float("nan")
    ab = torch.randn(6, 2 * 48, generator=g)
    nw = torch.randn(64, generator=g)
    B, T, H, Hk, D = 1, 5, 4, 2, 32
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    slots = torch.tensor([[6, 0, 3, 7, 2]])
    mask = torch.zeros(B, 1, T, 9)
    mask[0, 0, :, 4] = float("-inf")
    model = _q4(seed=2)
    ids = torch.randint(0, V, (1, 16), generator=g)
    tree = DraftTree([(0,), (1,), (0, 0), (1, 0)])

    def outputs() -> list[torch.Tensor]:
        out = [kernels.gemm_q4_1(x[:M], packed, scales, 101) for M in (1, 4, 9)]
        out += [kernels.gemm_q8_0(x[:M], codes, d, 101) for M in (1, 4, 9)]
        out += [kernels.linear_rows(xf, wf), kernels.linear_rows(xf.bfloat16(), wf.bfloat16())]
        out += list(kernels.topk(logits, 8, with_lse=True))
        out += [kernels.silu_mul(ab), kernels.rmsnorm(xf[:, :64].contiguous(), nw, 1e-5)]
        for kv in (torch.float32, torch.float16):
            k, v = torch.zeros(B, Hk, 9, D, dtype=kv), torch.zeros(B, Hk, 9, D, dtype=kv)
            q = qkv.clone()
            kernels.rope_store(q, H, Hk, cos, sin, k, v, slots)
            qh = q.view(B, T, H + 2 * Hk, D)[:, :, :H].transpose(1, 2)
            out += [q, k.float(), v.float(), kernels.attention(qh, k, v, mask)]
        cache = KVCache.for_model(model.cfg, 1, 40)
        forward_cached(model, ids[:, :11], cache, torch.arange(11)[None])
        out.append(forward_cached(model, ids[:, 11:16], cache, (11 + torch.tensor([0, 1, 1, 2, 2]))[None],
                                  extra_mask=tree.verify_mask(cache.length, "cpu")))
        return out

    here = outputs()
    monkeypatch.setattr(kernels, "_lib", portable)
    there = outputs()
    monkeypatch.setattr(kernels, "_lib", shipped)
    assert len(here) == len(there) == 22
    for i, (a, b) in enumerate(zip(here, there)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i


def test_a_compiler_without_openmp_builds_a_one_thread_library(tmp_path, monkeypatch):
    """Apple's clang refuses -fopenmp: the library is then built without it (its parallel loops run on one
    thread) and gives the same bits, rather than leaving q4 to the PyTorch reference. A compiler that fails
    otherwise still fails with its message."""
    cc = kernels._compiler()
    fake = tmp_path / "cc"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "clang: error: unsupported option '
                    f"'-fopenmp'\" >&2; exit 1; }}; done\nexec {cc} \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    cmd = kernels.compile_library(kernels._SRC, tmp_path / "one.so", portable=True)
    assert cmd[0] == str(fake) and "-fopenmp" not in cmd and "-ffp-contract=off" in cmd
    lib = kernels.open_library(tmp_path / "one.so")
    w, x = _weights(40, 256, seed=6)
    packed, scales = kernels.quantize_q4_1(w)
    want = kernels.gemm_q4_1(x[:5], packed, scales, 40)
    monkeypatch.setattr(kernels, "_lib", lib)
    assert torch.equal(kernels.gemm_q4_1(x[:5], packed, scales, 40), want)
    fake.write_text("#!/bin/sh\necho 'cc: error: no space left on device' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="no space left on device"):
        kernels.compile_library(kernels._SRC, tmp_path / "none.so", portable=True)


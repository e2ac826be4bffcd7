"""CPU capability detection and the batch-invariant kernels of the `q4` inference format.

Why our own kernels. Speculative decoding is lossless only if a row's logits do not depend on how many rows
share its forward (SPEC section 9). On CPU, PyTorch's dense matmuls (MKL), FBGEMM's fp16/int8 linears and
SDPA are not row-invariant; its weight-packed kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
and bf16 `F.linear` are, but are slower at one row than these kernels on AVX2 (bf16 about M times its
one-row cost), and PyTorch has no row-invariant attention (`python benchmarks/kernel_survey.py`,
docs/results/decode-cpu.md). The kernels in `csrc/qkernels.c` give both properties:

  * linears: weights in llama.cpp's Q4_1 (block linears) or Q8_0 (LM head) layouts, activations quantised
    per row and per group of 32 to int8 (Q8). Each 32-element block product is an *exact* int32 sum, and
    the float combination runs per row in a fixed order (documented in the C file). So a row's output is
    bit-identical whatever M is, and the weights are streamed once for all M rows.
  * attention: one query row at a time, with a fixed reduction order over the keys, so a decode step and
    a row of a verification forward agree bit for bit.

The kernels are plain C compiled by the machine's C compiler on first use (or by `python -m
midlayer.kernels`, which `scripts/setup.sh` runs) into a cache directory, and loaded with ctypes; AVX2
versions are selected at run time, with a portable scalar version that gives the same bits. Where no
compiler is available, `*_reference` (pure PyTorch) computes the same GEMM results bit for bit -- slowly
-- and attention falls back to SDPA, which is correct but *not* row-invariant (`batch_invariant()` is
then False and the engine stops calling the format lossless).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

QK = 32  # elements per quantisation block (Q4_1, Q8_0, Q8 activations)
_SRC = Path(__file__).with_name("csrc") / "qkernels.c"


# ============================================================================================ the CPU
@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    torch_capability: str  # what ATen's own dispatch picked (e.g. AVX2, AVX512)
    threads: int

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run natively (AVX512-BF16 or AMX-BF16); elsewhere bf16 is emulated and slow."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    def summary(self) -> str:
        keys = ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16"]
        have = [k for k in keys if self.has(k)]
        return (f"{self.model}; {', '.join(have) or 'no AVX2'}; torch {torch.__version__} "
                f"({self.torch_capability}), {self.threads} threads")


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """The CPU's model name and feature flags (Linux /proc/cpuinfo; elsewhere the platform's name only)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = val.strip()
            elif key == "flags":
                flags = set(val.split())
            if flags and model:
                if key == "flags":
                    break
    except OSError:
        pass
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "unknown"
    return CpuInfo(model, frozenset(flags), cap, torch.get_num_threads())


# ====================================================================================== the library
def _cache_dir() -> Path:
    root = os.environ.get("MIDLAYER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "midlayer")
    return Path(root)


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def library_path() -> Path:
    """Where the compiled library for this source and this Python lives (keyed by a hash of the source)."""
    tag = hashlib.sha256(_SRC.read_bytes()).hexdigest()[:16]
    return _cache_dir() / f"qkernels-{tag}-{platform.machine()}.so"


def build(verbose: bool = False) -> Path:
    """Compile csrc/qkernels.c (once per source version); raises RuntimeError with the compiler's message."""
    out = library_path()
    if out.exists():
        return out
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc): the q4 kernels fall back to PyTorch")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.so")
    # -ffp-contract=off: no fused multiply-adds, so the scalar and AVX2 paths (and the PyTorch reference)
    # round identically. OpenMP: the library joins the libgomp pool torch itself uses (same soname).
    cmd = [cc, "-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-o", str(tmp), str(_SRC), "-lm"]
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the q4 kernels are written for x86-64, not {platform.machine()}")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {_SRC.name} failed:\n{' '.join(cmd)}\n{res.stderr[-2000:]}")
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    os.replace(tmp, out)
    return out


_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None (with one warning) if that is impossible."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    if os.environ.get("MIDLAYER_NO_KERNELS"):
        _lib_error = "disabled by MIDLAYER_NO_KERNELS"
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        _lib_error = str(e)
        warnings.warn(f"midlayer kernels unavailable, using the PyTorch reference (slow, attention not "
                      f"row-invariant): {e}", RuntimeWarning, stacklevel=2)
        return None
    P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.qk_quantize_q8.argtypes = [P, L, I, I, P, P, P]
    lib.qk_gemm_q4_1.argtypes = [P, P, P, I, I, P, P, I, P, L]
    lib.qk_gemm_q8_0.argtypes = [P, P, I, I, P, P, I, P, L]
    lib.qk_attention.argtypes = [P, L, L, P, P, L, L, L, P, I, I, I, I, I, I, F, P, P]
    lib.qk_linear_q4_1.argtypes = [P, I, I, P, P, I, P, P]
    lib.qk_linear_q8_0.argtypes = [P, I, I, P, P, I, P, P]
    lib.qk_rmsnorm.argtypes = [P, P, I, I, F, P]
    lib.qk_rope_store.argtypes = [P, L, I, I, I, I, I, P, P, P, P, L, L, P]
    lib.qk_has_avx2.restype = I
    lib.qk_set_avx2.argtypes = [I]
    for f in ("qk_quantize_q8", "qk_gemm_q4_1", "qk_gemm_q8_0", "qk_attention", "qk_set_avx2", "qk_linear_q4_1",
              "qk_linear_q8_0", "qk_rmsnorm", "qk_rope_store"):
        getattr(lib, f).restype = None
    _lib = lib
    return lib


def available() -> bool:
    return library() is not None


def batch_invariant() -> bool:
    """True when every op of the q4 format is row-invariant (the compiled kernels are in use)."""
    return available()


def set_simd(on: bool) -> None:
    """Use the AVX2 paths (on, the default where the CPU has them) or the portable scalar ones (tests)."""
    lib = library()
    if lib is not None:
        lib.qk_set_avx2(1 if on else 0)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


_work = torch.empty(0, dtype=torch.uint8)


def _workspace(n_bytes: int) -> torch.Tensor:
    """A scratch buffer reused across calls (grown on demand): quantised activations, attention scores."""
    global _work
    if _work.numel() < n_bytes:
        _work = torch.empty(max(n_bytes, 2 * _work.numel()), dtype=torch.uint8)
    return _work


def _q8_bytes(M: int, K: int) -> int:
    return ((M * K + 63) & ~63) + 8 * M * (K // QK)


# ================================================================================ activations (Q8)
def quantize_q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q int8 [M, K], d [M, K/32], s [M, K/32]): d = amax/127 per group,
    q = round-half-even(x / d) (0 where d = 0), s = d * sum(q). The C kernel's exact arithmetic."""
    M, K = x.shape
    g = x.float().reshape(M, K // QK, QK)
    d = g.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(g * inv[..., None])
    s = d * q.sum(-1)
    return q.to(torch.int8).reshape(M, K), d, s


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lib = library()
    if lib is None:
        return quantize_q8_reference(x)
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8)
    d = torch.empty(M, K // QK)
    s = torch.empty(M, K // QK)
    lib.qk_quantize_q8(_ptr(x), K, M, K, _ptr(q), _ptr(d), _ptr(s))
    return q, d, s


# ===================================================================================== weights
def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed codes uint8 [N, K/32, 16], scales fp16 [N, K/32, 2] = (d, m)), w ~ d q + m.

    llama.cpp's Q4_1 block: d = (max - min)/15 and m = min, both stored in fp16; codes q in 0..15 are
    computed against the fp16 values, so a tensor that came from a Q4_1 file is recovered exactly. Byte j
    of a block holds element j (low nibble) and element j + 16 (high nibble)."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"q4: in_features {K} is not a multiple of {QK}")
    g = w.detach().float().reshape(N, K // QK, QK)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    q = ((g - m.float()[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.contiguous(), torch.stack([d, m], -1).contiguous()


def unpack_q4_1(packed: torch.Tensor) -> torch.Tensor:
    """Codes [N, G, 32] (0..15) from packed [N, G, 16]."""
    return torch.cat([packed & 0xF, packed >> 4], -1)


def dequantize_q4_1(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    q = unpack_q4_1(packed).float()
    N, G, _ = q.shape
    d, m = scales.float().unbind(-1)
    return (d[..., None] * q + m[..., None]).reshape(N, G * QK)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes int8 [N, K/32, 32], scales fp16 [N, K/32]), w ~ d q with d = amax/127 (fp16)."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"q8: in_features {K} is not a multiple of {QK}")
    g = w.detach().float().reshape(N, K // QK, QK)
    d = (g.abs().amax(-1) / 127).half()
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    q = (g / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.contiguous(), d.contiguous()


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    N, G, _ = codes.shape
    return (scales.float()[..., None] * codes.float()).reshape(N, G * QK)


# ======================================================================================== GEMMs
def _lane_sums(qw: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """Exact integer block products per lane: qw [N, 32], qx [M, 32] (float, integer-valued) -> [M, N, 8]
    where lane l sums elements 4l..4l+3 (every partial sum is an integer below 2^24: exact in fp32)."""
    return torch.einsum("nla,mla->mnl", qw.reshape(-1, 8, 4), qx.reshape(-1, 8, 4))


def _hsum8(acc: torch.Tensor) -> torch.Tensor:
    a = acc.unbind(-1)
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def gemm_q4_1_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] times the Q4_1 weight, with Q8 activations, in the C kernel's exact order."""
    qx, dx, sx = quantize_q8_reference(x)
    qw = unpack_q4_1(packed).float()  # [N, G, 32]
    dw, mw = scales.float().unbind(-1)  # [N, G]
    M, N, G = x.shape[0], qw.shape[0], qw.shape[1]
    qxf = qx.float().reshape(M, G, QK)
    acc = torch.zeros(M, N, 8)
    macc = torch.zeros(M, N)
    for g in range(G):
        sc = dw[None, :, g] * dx[:, None, g]  # [M, N]
        acc = acc + sc[..., None] * _lane_sums(qw[:, g], qxf[:, g])
        macc = macc + mw[None, :, g] * sx[:, None, g]
    return _hsum8(acc) + macc


def gemm_q8_0_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    qx, dx, _ = quantize_q8_reference(x)
    qw = codes.float()
    dw = scales.float()
    M, N, G = x.shape[0], qw.shape[0], qw.shape[1]
    qxf = qx.float().reshape(M, G, QK)
    acc = torch.zeros(M, N, 8)
    for g in range(G):
        acc = acc + (dw[None, :, g] * dx[:, None, g])[..., None] * _lane_sums(qw[:, g], qxf[:, g])
    return _hsum8(acc)


def gemm_q4_1(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (CPU) -> [M, N]; bit-identical to `gemm_q4_1_reference` (one C call)."""
    lib = library()
    if lib is None or x.device.type != "cpu":
        return gemm_q4_1_reference(x.cpu(), packed.cpu(), scales.cpu()).to(x.device)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    M, K = x.shape
    N = packed.shape[0]
    y = torch.empty(M, N)
    lib.qk_linear_q4_1(x.data_ptr(), M, K, packed.data_ptr(), scales.data_ptr(), N, y.data_ptr(),
                       _workspace(_q8_bytes(M, K)).data_ptr())
    return y


def gemm_q8_0(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (CPU) -> [M, N]; bit-identical to `gemm_q8_0_reference` (one C call)."""
    lib = library()
    if lib is None or x.device.type != "cpu":
        return gemm_q8_0_reference(x.cpu(), codes.cpu(), scales.cpu()).to(x.device)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N)
    lib.qk_linear_q8_0(x.data_ptr(), M, K, codes.data_ptr(), scales.data_ptr(), N, y.data_ptr(),
                       _workspace(_q8_bytes(M, K)).data_ptr())
    return y


# ====================================================================================== RMSNorm
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim in one C call (fp32 CPU, no autograd);
    None where that does not apply (the caller computes it in PyTorch)."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.requires_grad or weight.requires_grad and torch.is_grad_enabled()):
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    K = x.shape[-1]
    lib.qk_rmsnorm(x.data_ptr(), weight.data_ptr(), x.numel() // K, K, float(eps), y.data_ptr())
    return y


# ========================================================================== RoPE + KV-cache store
def rope_store(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """For a fused projection qkv [B, T, (H + 2 Hk) d] (contiguous fp32): rotate q in place (RoPE,
    rotate-half), and write rotated k and v to k_cache/v_cache [B, Hk, S_max, d] at slots [B, T]."""
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    cos = cos.reshape(B, T, D).contiguous()
    sin = sin.reshape(B, T, D).contiguous()
    slots = slots.reshape(B, T).to(torch.long).contiguous()
    library().qk_rope_store(qkv.data_ptr(), qkv.stride(0), B, T, n_heads, n_kv_heads, D, cos.data_ptr(),
                            sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                            k_cache.stride(1), slots.data_ptr())


# ===================================================================================== attention
def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                        ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in fp32: q [B, H, T, d], k/v [B, Hk, S, d], mask [B, 1, T, S]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s = q.float() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s + mask.float()
    return s.softmax(-1) @ v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              n_keys: int | None = None) -> torch.Tensor:
    """Row-invariant attention. q [B, H, T, d] (any strides with a unit last stride), k/v [B, Hk, S, d]
    views with equal strides and a unit last stride (e.g. the KV cache buffers, of which only the first
    `n_keys` slots are read), mask [B, 1, T, n_keys] additive or None (every key visible).
    Returns [B, H, T, d] fp32."""
    lib = library()
    if n_keys is not None:
        k, v = k[:, :, :n_keys], v[:, :, :n_keys]
    if lib is None or q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype != torch.float32:
        return attention_reference(q, k, v, mask)
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if q.stride(-1) != 1 or k.stride() != v.stride() or k.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # The kernel addresses q as (b, t, h): q + b*qb + t*qt + h*D, which needs heads at stride D.
    if q.stride(1) != D:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    m = None
    if mask is not None:
        m = mask if mask.dtype == torch.float32 and mask.shape == (B, 1, T, S) and mask.is_contiguous() \
            else mask.float().expand(B, 1, T, S).contiguous()
    out = torch.empty(B, T, H, D)
    scratch = _workspace(4 * B * T * H * S)
    lib.qk_attention(_ptr(q), q.stride(0), q.stride(2), _ptr(k), _ptr(v), k.stride(0), k.stride(1), k.stride(2),
                     _ptr(m) if m is not None else None, B, T, H, Hk, S, D, float(D ** -0.5), _ptr(out),
                     _ptr(scratch))
    return out.transpose(1, 2)


if __name__ == "__main__":  # `python -m midlayer.kernels`: build now (scripts/setup.sh) and report
    try:
        path = build(verbose=True)
        print(f"built {path}")
    except RuntimeError as e:
        print(f"not built: {e}", file=sys.stderr)
    print(cpu_info().summary())

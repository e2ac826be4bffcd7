"""CPU capability detection and the batch-invariant kernels of the `q4` inference format.

Why our own kernels. Speculative decoding is lossless only if a row's logits do not depend on how many rows
share its forward (SPEC section 9). On CPU, PyTorch's dense matmuls (MKL), FBGEMM's fp16/int8 linears and
SDPA are not row-invariant; its weight-packed kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
and bf16 `F.linear` are, but are slower at one row than these kernels on AVX2 (bf16 about M times its
one-row cost), and PyTorch has no row-invariant attention (`python benchmarks/kernel_survey.py`,
docs/results/decode-cpu.md). The kernels in `csrc/qkernels.c` give both properties:

  * linears: weights in llama.cpp's Q4_1 (block linears) or Q8_0 (LM head) block formats, stored with the
    outputs interleaved by groups of 8 so that one AVX2 register holds 8 outputs' codes; activations
    quantised per row and per group of 32 to int8 (Q8). Each 32-element block product is an *exact* int32
    sum, and the float combination runs per row in a fixed order (the "canonical order" in the C file's
    header, which `gemm_*_reference` reproduces). So a row's output is bit-identical whatever M is, and the
    weights are streamed once for all M rows.
  * attention: one query row at a time, with a fixed reduction order over the keys, so a decode step and
    a row of a verification forward agree bit for bit.
  * a whole block (`block_q4`): RMSNorm, the fused q|k|v projection, RoPE + cache store, attention, the
    output projection, the SwiGLU FFN and both residual adds in ONE call -- the same functions in the same
    order as the module-by-module path, so the same bits, without ~15 Python calls per block.
  * an fp32 and bf16 linear (`linear_rows`): each output summed in fp32 in 16 lanes in a fixed order that
    depends on K alone, for fp32 and bf16 models in the static decode step on a CPU whose BLAS rounds a row
    by M (an AVX-512 Xeon's MKL); `linear_rows_reference` is the same formula in PyTorch, bit for bit.

The kernels are plain C compiled by the machine's C compiler on first use (or by `midlayer kernels`,
which `scripts/setup.sh` runs, or `python -m midlayer.ops.kernels`) into a cache directory, and loaded with ctypes; AVX2
versions (and AVX512-VNNI GEMM tiles, `set_simd`) are selected at run time on x86-64, with a portable scalar
version that gives the same bits. Other CPUs (arm64: Apple silicon, Graviton) compile the portable version
alone, so their q4 decoding is lossless too and gives x86's bits (docs/results/decode-cpu.md, 61st session);
a compiler without OpenMP (Apple's clang) builds a one-thread library. Where no
compiler is available, `*_reference` (pure PyTorch) computes the same GEMM results bit for bit -- slowly
-- and attention falls back to SDPA, which is correct but *not* row-invariant (`batch_invariant()` is
then False and the engine stops calling the format lossless).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import torch

from midlayer.common import cache_dir, file_sha256

QK = 32  # elements per quantisation block (Q4_1, Q8_0, Q8 activations)
_SRC = Path(__file__).with_name("csrc") / "qkernels.c"


def _unintercepted(fn: Callable) -> Callable:
    """`fn` run with PyTorch's torch-function handling off: its shape checks, strides and pointers are then
    C++ calls, not Python dispatches of a TorchFunctionMode. Inside the static step's forward
    (row_linear.RowLinears, which sends the linears to the C kernel) every tensor call of a wrapper below would
    otherwise cross Python: ~3,200 a SmolLM2 fp32 step, where the mode cost 49 against 38 ms/token on an
    AVX-512 Xeon (docs/results/static-step.md). With no mode active (the dynamic engine) or inside a
    torch.compile trace (dynamo traces `fn`) it changes nothing."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch._C._is_torch_function_mode_enabled() or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return run


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

    def vector_flags(self) -> list[str]:
        """The vector extensions that pick CPU kernels, ours and ATen's (timings differ between machines)."""
        keys = ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16"]
        return [k for k in keys if self.has(k)]

    def summary(self) -> str:
        have = self.vector_flags() or (["no AVX2"] if platform.machine() in ("x86_64", "AMD64") else
                                       [f"{platform.machine()}: the kernels' portable versions"])
        return (f"{self.model}; {', '.join(have)}; torch {torch.__version__} "
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

def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def library_path() -> Path:
    """Where the compiled library for this source and this Python lives (keyed by a hash of the source)."""
    tag = file_sha256(_SRC)[:16]
    return cache_dir() / f"qkernels-{tag}-{platform.machine()}.so"


def _record_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".json")


def cached_library_problem(out: Path) -> str | None:
    """Why the cached library `out` must not be loaded, or None. It is trusted only if its record (written
    after a build) names this source and the library's own bytes: an empty, truncated (loading one can kill
    the process with SIGBUS) or replaced file, or one from other source, is never loaded (issue 43)."""
    rec = _record_path(out)
    try:
        meta = json.loads(rec.read_text())
    except FileNotFoundError:
        return "no build record beside it"
    except (OSError, ValueError) as e:
        return f"its build record is unreadable ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("source_sha256") != file_sha256(_SRC):
        return "built from other source"
    if not out.stat().st_size or meta.get("sha256") != file_sha256(out):
        return "its bytes are not the ones built (empty, truncated or replaced)"
    return None


def compile_library(src: Path, out: Path, portable: bool = False) -> list[str]:
    """Compile the kernel source `src` into the shared library `out` (the one compile command: `build` uses it,
    and benchmarks/kernel_variant.py for a changed copy of the source); returns the command. `portable`: the
    scalar versions alone, as a CPU other than x86-64 builds them (-DQK_PORTABLE; the tests' check of that
    build). A compiler that refuses -fopenmp (Apple's clang) builds without it: one thread, the same bits.
    RuntimeError with the compiler's message, or where no compiler."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc): the q4 kernels fall back to PyTorch")
    # -ffp-contract=off: no fused multiply-adds the source does not write, so the scalar and AVX2 paths (and
    # the PyTorch reference) round identically (the attention's are explicit in both: fmaf, vfmadd); gcc on
    # arm64 would fuse by default. OpenMP: the library joins the libgomp pool torch itself uses (same soname).
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off"] + (["-DQK_PORTABLE"] if portable else [])
    tail = ["-o", str(out), str(src), "-lm"]
    cmd = [cc, *flags, "-fopenmp", *tail]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 and "openmp" in res.stderr.lower():
        cmd = [cc, *flags, "-Wno-unknown-pragmas", *tail]  # (the pragmas then do nothing: one thread)
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{res.stderr[-2000:]}")
    return cmd


def build(verbose: bool = False) -> Path:
    """Compile csrc/qkernels.c (once per source version), or return the cached library when its build record
    vouches for it (`cached_library_problem`; a damaged one is rebuilt, with a note); raises RuntimeError
    with the compiler's message."""
    out = library_path()
    if out.exists():
        why = cached_library_problem(out)
        if why is None:
            return out
        warnings.warn(f"rebuilding the kernel library {out}: {why}", RuntimeWarning, stacklevel=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of its own per build: processes and threads building at once each write their own files (the pid
    # alone was shared by two threads, and one loaded the other's half-written or just-moved file), and the
    # compiler creates the library with the umask's mode (a mkstemp file kept 0600: 0711, unreadable to others)
    work = Path(tempfile.mkdtemp(prefix=out.stem + ".tmp", dir=out.parent))
    try:
        tmp = work / out.name
        cmd = compile_library(_SRC, tmp)
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        record = json.dumps({"sha256": file_sha256(tmp), "source_sha256": file_sha256(_SRC), "command": cmd[:-3]})
        rec_tmp = _record_path(tmp)
        rec_tmp.write_text(record)
        os.replace(tmp, out)  # the library first, then the record that vouches for it: a crash between leaves
        os.replace(rec_tmp, _record_path(out))  # a library without a record, which is rebuilt
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


_lib_lock = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use (once, however many threads ask at once); None (with
    one warning) if that is impossible."""
    if _lib is not None or _lib_error is not None:
        return _lib
    with _lib_lock:
        return _load_library()


def _load_library() -> ctypes.CDLL | None:
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:  # (another thread loaded it while this one waited)
        return _lib
    if os.environ.get("MIDLAYER_NO_KERNELS"):
        _lib_error = "disabled by MIDLAYER_NO_KERNELS"
        return None
    try:
        lib = open_library(build())
    except (RuntimeError, OSError) as e:
        _lib_error = str(e)
        warnings.warn(f"midlayer kernels unavailable, using the PyTorch reference (slow, attention not "
                      f"row-invariant): {e}", RuntimeWarning, stacklevel=2)
        return None
    _lib = lib
    return lib


def open_library(path: Path) -> ctypes.CDLL:
    """The compiled library at `path`, its functions' argument and result types declared (OSError if it cannot
    be loaded)."""
    lib = ctypes.CDLL(str(path))
    P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.qk_quantize_q8.argtypes = [P, L, I, I, P, P, P]
    lib.qk_gemm_q4_1.argtypes = [P, P, P, I, I, P, P, I, P, L]
    lib.qk_gemm_q8_0.argtypes = [P, P, I, I, P, P, I, P, L]
    lib.qk_attention.argtypes = [P, L, L, P, P, L, L, L, P, I, I, I, I, I, I, F, P, P, I, I]
    lib.qk_linear_q4_1.argtypes = [P, I, I, P, P, I, P, P]
    lib.qk_linear_q8_0.argtypes = [P, I, I, P, P, I, P, P]
    lib.qk_rmsnorm.argtypes = [P, P, I, I, F, P]
    lib.qk_rope_store.argtypes = [P, L, I, I, I, I, I, P, P, P, P, L, L, P, I]
    lib.qk_silu_mul.argtypes = [P, I, I, P]
    lib.qk_topk.argtypes = [P, I, I, L, I, P, P, P]
    lib.qk_blocks_q4.argtypes = [P, P, P, I, I, I, I, I, I, I, I, F, F, P, P, P, P, P, L, L, L, L, P, P, I, I, P, I]
    lib.qk_block_q4_work.argtypes = [I, I, I, I, I, I, I]
    lib.qk_block_q4_work.restype = L
    lib.qk_block_q4.argtypes = [P, P, I, I, I, I, I, I, I, F, F] + [P] * 14 + [P, P, L, L, L, P, P, I, I, P, I]
    lib.qk_has_avx2.restype = I
    lib.qk_simd_level.restype = I
    lib.qk_gemm_tiles.restype = I
    lib.qk_linear_tiles.restype = I
    lib.qk_linear_f32.argtypes = lib.qk_linear_bf16.argtypes = [P, L, I, I, P, L, I, P, L]
    lib.qk_set_simd.argtypes = [I]
    lib.qk_set_avx2.argtypes = [I]
    for f in ("qk_quantize_q8", "qk_gemm_q4_1", "qk_gemm_q8_0", "qk_attention", "qk_set_avx2", "qk_set_simd", "qk_linear_q4_1",
              "qk_linear_q8_0", "qk_rmsnorm", "qk_rope_store", "qk_silu_mul", "qk_block_q4", "qk_topk",
              "qk_blocks_q4", "qk_linear_f32", "qk_linear_bf16"):
        getattr(lib, f).restype = None
    return lib


def available() -> bool:
    return library() is not None


def release_threads() -> bool:
    """Free the calling thread's OpenMP worker pool of the kernels' runtime (`omp_pause_resource_all`, OpenMP
    5.0; libgomp's pool is per master thread). Call it in a thread that hands the kernels over to another one
    (the server's engine thread, the API's speculative stream).

    Why: libgomp throttles its workers' spin-wait (to ~1000 iterations) once it manages more threads than there
    are CPUs, and a pool left docked by the thread that loaded the model counts. The second thread's parallel
    regions then park and wake their workers through the kernel at every region: on 2 cores a SmolLM2-135M q4
    decode step (~180 regions) took 10.9 ms from a thread after the load in the main thread, 3.6 ms after this
    call, 3.5 ms when the load ran in that same thread (benchmarks/omp_threads.py, docs/results/serve-cpu.md).
    True when the pool was released; False where the runtime has no such call (then nothing changes)."""
    if not available():
        return False
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all  # the runtime the kernels link (-fopenmp)
    except (OSError, AttributeError):
        return False
    pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
    return pause(2) == 0  # omp_pause_hard: the pool's threads end; the next region starts a fresh one


def unavailable_reason() -> str | None:
    """Why the kernels are not in use (the build's or the loader's message, first line), or None."""
    return None if available() else (str(_lib_error or "unknown").strip().splitlines() or ["unknown"])[0][:200]


def batch_invariant() -> bool:
    """True when every op of the q4 format is row-invariant (the compiled kernels are in use)."""
    return available()


# what the kernels can use; every level gives the same bits. "avx512-vnni": the GEMM tiles on 256-bit registers;
# "avx512-vnni-zmm": on 512-bit registers, two output groups a tile (needs AVX512-BW too).
SIMD_LEVELS = ("scalar", "avx2", "avx512-vnni", "avx512-vnni-zmm")


def set_simd(level: bool | int) -> None:
    """Use at most SIMD level `level` (tests compare them): True = the best the CPU has (the default),
    False / 0 = the portable scalar paths, 1 = AVX2, 2 = AVX2 with AVX512-VNNI GEMM tiles on 256-bit registers,
    3 = the VNNI tiles on 512-bit registers. A level the CPU lacks falls back to the best it has."""
    lib = library()
    if lib is not None:
        lib.qk_set_simd(-1 if level is True else int(level))


def simd_levels() -> list[int]:
    """Every SIMD level this CPU can run, scalar first (the level in use is left as it is)."""
    lib = library()
    if lib is None:
        return []
    now = lib.qk_simd_level()
    lib.qk_set_simd(-1)
    best = lib.qk_simd_level()
    lib.qk_set_simd(now)
    return list(range(best + 1))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


_work = threading.local()  # one scratch buffer per thread: two threads' calls shared one and read each other's


def _workspace(n_bytes: int) -> torch.Tensor:
    """This thread's scratch buffer, reused across calls (grown on demand): quantised activations, attention
    scores."""
    buf = getattr(_work, "buf", None)
    if buf is None or buf.numel() < n_bytes:
        buf = _work.buf = torch.empty(max(n_bytes, 2 * (0 if buf is None else buf.numel())), dtype=torch.uint8)
    return buf


def _q8_bytes(M: int, K: int) -> int:
    return ((M * K + 63) & ~63) + 8 * M * (K // QK)


# ================================================================================ activations (Q8)
def quantize_q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q int8 [M, K], d [M, K/32], s [M, K/32]): d = amax/127 per group,
    q = round-half-even(x / d) (0 where d is below the smallest normal float, whose inverse can overflow),
    s = d * sum(q); a group holding a NaN or an infinity: q = 0, d = s = NaN (every output it feeds is NaN). The C
    kernel's exact arithmetic (q8_inverse, q8_group_nan)."""
    M, K = x.shape
    g = x.float().reshape(M, K // QK, QK)
    bad = ~torch.isfinite(g).all(-1)
    g = torch.where(bad[..., None], torch.zeros_like(g), g)
    d = g.abs().amax(-1) / 127.0
    normal = d >= torch.finfo(torch.float32).tiny
    inv = torch.where(normal, 1.0 / torch.where(normal, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(g * inv[..., None])
    nan = torch.full_like(d, float("nan"))
    s = torch.where(bad, nan, d * q.sum(-1))
    return q.to(torch.int8).reshape(M, K), torch.where(bad, nan, d), s


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
# Both weight layouts interleave the outputs by groups of 8 (csrc/qkernels.c's header has the byte map):
# N is padded up to a multiple of 8 with zero codes and zero scales, so the layout alone does not say how
# many outputs are real -- the dequantisers and GEMMs take `n` (default: all 8 * groups, padding included).
def _groups(N: int) -> int:
    return (N + 7) // 8


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _out_features(n: int | None, groups: int) -> int:
    if n is None:
        return 8 * groups
    if not 8 * groups - 8 < n <= 8 * groups:
        raise ValueError(f"{n} outputs do not fit a layout of {groups} groups of 8")
    return n


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes uint8 [ceil(N/8), K/32, 128], scales fp16 [ceil(N/8), K/32, 2, 8]), w ~ d q + m.

    llama.cpp's Q4_1 block: d = (max - min)/15 and m = min, both stored in fp16; codes q in 0..15 are
    computed against the fp16 values, so a tensor that came from a Q4_1 file is recovered exactly. Layout,
    per group o of 8 outputs and block g: byte 32 v + 4 j + i holds element 4 v + i of output 8 o + j in its
    low nibble and element 16 + 4 v + i in its high nibble (v = 0..3, i = 0..3); scales[o, g] = (d of the 8
    outputs, m of the 8 outputs)."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"q4: in_features {K} is not a multiple of {QK}")
    G, O = K // QK, _groups(N)
    g = w.detach().float().reshape(N, G, QK)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    q = ((g - m.float()[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
    q, d, m = _pad_rows(q, 8 * O), _pad_rows(d, 8 * O), _pad_rows(m, 8 * O)
    q = q.reshape(O, 8, G, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # (o, g, nibble, v, j, i)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(O, G, 128)
    scales = torch.stack([d.reshape(O, 8, G), m.reshape(O, 8, G)], 2).permute(0, 3, 2, 1)  # (o, g, d|m, j)
    return packed.contiguous(), scales.contiguous()


def unpack_q4_1(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Codes [n, G, 32] (0..15, natural element order) from the interleaved layout."""
    O, G, _ = packed.shape
    p = packed.reshape(O, G, 4, 8, 4)  # (o, g, v, j, i)
    q = torch.stack([p & 0xF, p >> 4], 2)  # (o, g, nibble, v, j, i)
    return q.permute(0, 4, 1, 2, 3, 5).reshape(8 * O, G, QK)[:_out_features(n, O)]


def _q4_1_scales(scales: torch.Tensor, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m), each fp32 [n, G], from scales [O, G, 2, 8]."""
    O, G = scales.shape[:2]
    s = scales.float().permute(2, 0, 3, 1).reshape(2, 8 * O, G)[:, :_out_features(n, O)]
    return s[0], s[1]


def dequantize_q4_1(packed: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """The weight [n, K] fp32 the codes and scales represent."""
    q = unpack_q4_1(packed, n).float()
    d, m = _q4_1_scales(scales, n)
    return (d[..., None] * q + m[..., None]).reshape(q.shape[0], -1)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes int8 [ceil(N/8), K/32, 256], scales fp16 [ceil(N/8), K/32, 8]), w ~ d q with
    d = amax/127 (fp16). Layout, per group o of 8 outputs and block g: byte 32 c + 4 j + i holds element
    4 c + i of output 8 o + j (c = 0..7, i = 0..3); scales[o, g] = d of the 8 outputs."""
    N, K = w.shape
    if K % QK:
        raise ValueError(f"q8: in_features {K} is not a multiple of {QK}")
    G = K // QK
    g = w.detach().float().reshape(N, G, QK)
    d = (g.abs().amax(-1) / 127).half()
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    q = (g / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return _pack_q8_0(q, d)


def _pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes int8 [N, G, 32] and fp16 scales [N, G], natural order -> the interleaved layout (quantize_q8_0)."""
    N, G, _ = q.shape
    O = _groups(N)
    q, d = _pad_rows(q, 8 * O), _pad_rows(d, 8 * O)
    codes = q.reshape(O, 8, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(O, G, 256)  # (o, g, c, j, i)
    return codes.contiguous(), d.reshape(O, 8, G).permute(0, 2, 1).contiguous()


def select_rows_q8_0(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, n: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q8_0 weight of outputs `rows` (in that order): their codes and scales copied, no float round
    trip -- exactly the head's own weights on those rows. Where a block's scale is a normal fp16 number
    this is also what quantize_q8_0 of the dequantised rows gives (the block's largest |code| is 127, so
    d' = (127 d) / 127 = d and every code comes back); where it is subnormal (a block whose values are all
    below ~8e-3) requantising would not even restore the weights, and copying does (tested)."""
    O, G, _ = scales.shape
    q = unpack_q8_0(codes, n).index_select(0, rows)
    d = scales.permute(0, 2, 1).reshape(8 * O, G)[:_out_features(n, O)].index_select(0, rows)
    return _pack_q8_0(q, d)


def unpack_q8_0(codes: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Codes [n, G, 32] (int8, natural element order) from the interleaved layout."""
    O, G, _ = codes.shape
    q = codes.reshape(O, G, 8, 8, 4).permute(0, 3, 1, 2, 4)  # (o, j, g, c, i)
    return q.reshape(8 * O, G, QK)[:_out_features(n, O)]


def _q8_0_scales(scales: torch.Tensor, n: int | None) -> torch.Tensor:
    O, G, _ = scales.shape
    return scales.float().permute(0, 2, 1).reshape(8 * O, G)[:_out_features(n, O)]


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """The weight [n, K] fp32 the codes and scales represent."""
    q = unpack_q8_0(codes, n).float()
    return (_q8_0_scales(scales, n)[..., None] * q).reshape(q.shape[0], -1)


# ======================================================================================== GEMMs
def _block_dots(qw: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """Exact integer block products: codes qw [N, G, 32], qx [M, G, 32] -> isum [M, N, G] as fp32.
    Computed in float64, where every product and partial sum is an integer below 2^53 (exact whatever
    the summation order); |isum| <= 32 * 127 * 127 < 2^24, so the fp32 result is exact too."""
    return torch.einsum("ngk,mgk->mng", qw.double(), qx.double()).float()


def gemm_q4_1_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int | None = None
                        ) -> torch.Tensor:
    """y [M, n] = x [M, K] times the Q4_1 weight, with Q8 activations, in the C kernel's canonical order:
    acc <- (acc + (d_w d_x) isum) + m_w s_x over the blocks g in order, each op rounded to fp32."""
    qx, dx, sx = quantize_q8_reference(x)
    qw = unpack_q4_1(packed, n)  # [N, G, 32]
    dw, mw = _q4_1_scales(scales, n)  # [N, G]
    M, N, G = x.shape[0], qw.shape[0], qw.shape[1]
    isum = _block_dots(qw, qx.reshape(M, G, QK))  # [M, N, G]
    acc = torch.zeros(M, N)
    for g in range(G):
        acc = acc + (dw[None, :, g] * dx[:, None, g]) * isum[:, :, g]
        acc = acc + mw[None, :, g] * sx[:, None, g]
    return acc


def gemm_q8_0_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int | None = None
                        ) -> torch.Tensor:
    """y [M, n] for Q8_0 weights: acc <- acc + (d_w d_x) isum over the blocks g in order."""
    qx, dx, _ = quantize_q8_reference(x)
    qw = unpack_q8_0(codes, n)
    dw = _q8_0_scales(scales, n)
    M, N, G = x.shape[0], qw.shape[0], qw.shape[1]
    isum = _block_dots(qw, qx.reshape(M, G, QK))
    acc = torch.zeros(M, N)
    for g in range(G):
        acc = acc + (dw[None, :, g] * dx[:, None, g]) * isum[:, :, g]
    return acc


def _linear(c_name: str, reference: Callable, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
            n: int | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, n] through the fused C linear `c_name` (quantise x to Q8 in the workspace, then
    the GEMM), or through `reference` (same bits) where the library is missing or x is not on the CPU."""
    lib = library()
    if lib is None or x.device.type != "cpu":
        return reference(x.cpu(), codes.cpu(), scales.cpu(), n).to(x.device)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    M, K = x.shape
    if K != codes.shape[1] * QK:
        raise ValueError(f"x has {K} features, the weight {codes.shape[1] * QK}")
    N = _out_features(n, codes.shape[0])
    y = torch.empty(M, N)
    getattr(lib, c_name)(x.data_ptr(), M, K, codes.data_ptr(), scales.data_ptr(), N, y.data_ptr(),
                         _workspace(_q8_bytes(M, K)).data_ptr())
    return y


def gemm_q4_1(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 (CPU) -> [M, n]; bit-identical to `gemm_q4_1_reference` (one C call)."""
    return _linear("qk_linear_q4_1", gemm_q4_1_reference, x, packed, scales, n)


def gemm_q8_0(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 (CPU) -> [M, n]; bit-identical to `gemm_q8_0_reference` (one C call)."""
    return _linear("qk_linear_q8_0", gemm_q8_0_reference, x, codes, scales, n)


# ====================================================================================== fp32 and bf16 linears
LANES = 16  # the row linear's lanes (qkernels.c, "fp32 and bf16 linears, row-invariant")
LINEAR_DTYPES = (torch.float32, torch.bfloat16)


def fma_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c for fp32 tensors, rounded once to fp32 (IEEE 754's fusedMultiplyAdd, C's fmaf), elementwise, in
    fp64 arithmetic. The product of two fp32 is exact in fp64 (48 significant bits). Its sum with c rounds to
    fp64, and Knuth's TwoSum recovers that rounding's error exactly. Rounding the fp64 sum to fp32 then gives
    the exact sum's rounding except where the sum landed on a tie between two fp32 that the exact sum was not
    on; the error's sign says which side the exact sum lies."""
    p, cd = a.double() * b.double(), c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)  # s + err == p + c exactly (TwoSum)
    r = s.float()
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=r.device)
    other = torch.nextafter(r, torch.where(s > r.double(), inf, -inf))  # r's neighbour on s's side
    tie = (r.double() + other.double()) * 0.5 == s  # (exact: two adjacent fp32 and their half in fp64)
    up = torch.where(err > 0, torch.maximum(r, other), torch.minimum(r, other))
    return torch.where(tie & (err != 0) & err.isfinite(), up, r)  # (inf, NaN: err is NaN, and r is fma's)


def linear_rows_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in fp32 in the C kernel's lane order, in PyTorch, bit for bit: lane j sums the
    products of k = j, j + 16, ... in increasing k, each a fused multiply-add L_j <- fma(x_k, w_k, L_j) (x and w
    widened to fp32 and padded with +0 to a multiple of 16; `fma_reference`; a bf16 product is exact in fp32, so
    there fused and unfused agree), then s_j = L_j + L_(j+8) and hsum8's tree ((s0+s4)+(s2+s6)) +
    ((s1+s5)+(s3+s7)). Returns fp32. Slow (K / 16 elementwise steps over [M, N, 16]): the tests' reference, and
    the path where the library is missing."""
    M, K = x.shape
    pad = -K % LANES
    xp, wp = (torch.nn.functional.pad(t.float(), (0, pad)) for t in (x, weight))
    lanes = torch.zeros(M, weight.shape[0], LANES, dtype=torch.float32, device=x.device)
    for k in range(0, K + pad, LANES):
        lanes = fma_reference(xp[:, None, k:k + LANES], wp[None, :, k:k + LANES], lanes)
    s = lanes[..., :8] + lanes[..., 8:]
    t = s[..., :4] + s[..., 4:]  # (s0+s4, s1+s5, s2+s6, s3+s7)
    u = t[..., :2] + t[..., 2:]  # ((s0+s4)+(s2+s6), (s1+s5)+(s3+s7))
    return u[..., 0] + u[..., 1]


def takes_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear_rows` runs the C kernel for these operands: x and weight of one dtype, fp32 or bf16, on the
    CPU, no autograd, the library built."""
    return (x.device.type == "cpu" and x.dtype in LINEAR_DTYPES and weight.dtype == x.dtype
            and weight.device.type == "cpu" and not x.requires_grad
            and not (weight.requires_grad and torch.is_grad_enabled()) and available())


def _linear_rows_2d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in fp32, in the lane order: the C kernel where `takes_linear`, else the
    reference (the same bits)."""
    if not takes_linear(x, weight):
        return linear_rows_reference(x, weight)
    K, N = x.shape[1], weight.shape[0]
    if x.stride(1) != 1 or x.stride(0) < K:
        x = x.contiguous()
    w = weight if weight.stride(1) == 1 and weight.stride(0) >= K else weight.contiguous()
    y = torch.empty(x.shape[0], N)
    if y.numel():
        fn = library().qk_linear_f32 if x.dtype == torch.float32 else library().qk_linear_bf16
        fn(_ptr(x), x.stride(0), x.shape[0], K, _ptr(w), w.stride(0), N, _ptr(y), N)
    return y


# `_linear_rows_2d` as a PyTorch custom op: what a torch.compile trace calls (a ctypes call there would break the
# graph), so a compiled step runs the very kernel of the eager one. Registered at import (once a process): dynamo
# cannot trace a registration made inside a trace.
if not hasattr(torch.ops.midlayer, "linear_rows"):
    torch.library.custom_op("midlayer::linear_rows", _linear_rows_2d, mutates_args=(),
                            schema="(Tensor x, Tensor weight) -> Tensor").register_fake(
        lambda x, weight: x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32))


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] and weight [N, K] of one dtype, fp32 or bf16, each row's bits
    independent of the rows that share the call (qkernels.c: a fixed lane order that depends on K alone, the
    same on every SIMD level; bf16 operands widened to fp32, exactly): one C call where `takes_linear` (in a
    torch.compile trace through the custom op midlayer::linear_rows), else `linear_rows_reference` (the same
    bits, slowly). The fp32 result plus the bias is rounded to x's dtype once.
    What the static decode step's linears run with linear="c" on a CPU whose BLAS rounds a row by M
    (engine/decode_step.py)."""
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"linear_rows: x [..., {K}], weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: want weight [N, {K}] and bias [N]")
    if x.dtype not in LINEAR_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"linear_rows: x {x.dtype} and weight {weight.dtype}: want one dtype, fp32 or bf16")
    x2 = x.reshape(-1, K)
    y = torch.ops.midlayer.linear_rows(x2, weight) if torch.compiler.is_compiling() else _linear_rows_2d(x2, weight)
    y = y.view(*x.shape[:-1], N)
    return (y if bias is None else y + bias.float()).to(x.dtype)


def _eligible(x: torch.Tensor) -> bool:
    """Whether an element-wise C kernel may take x: fp32 on the CPU, no autograd, and not inside a
    torch.compile trace (a ctypes call there is a graph break; the traced step computes the op in PyTorch).
    Checked before the library is touched, so a GPU run never builds or loads it (issue 42)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad
            and not torch.compiler.is_compiling())


# ====================================================================================== RMSNorm
@_unintercepted
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim in one C call (fp32 CPU, no autograd);
    None where that does not apply (the caller computes it in PyTorch)."""
    if (not _eligible(x) or weight.dtype != torch.float32 or weight.requires_grad and torch.is_grad_enabled()):
        return None
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    K = x.shape[-1]
    lib.qk_rmsnorm(x.data_ptr(), weight.data_ptr(), x.numel() // K, K, float(eps), y.data_ptr())
    return y


# ======================================================================================== SwiGLU
@_unintercepted
def silu_mul(ab: torch.Tensor) -> torch.Tensor | None:
    """silu(a) * b for ab = [a | b] [..., 2h] (a GLU's fused w1|w3 output) -> [..., h] in one C call (fp32 CPU,
    no autograd), row-invariant; None where that does not apply (the caller computes it in PyTorch). Its
    exp is the attention kernel's (csrc/qkernels.c), so it differs from torch's silu in the last bits only."""
    if not _eligible(ab) or ab.shape[-1] % 2:
        return None
    lib = library()
    if lib is None:
        return None
    ab = ab.contiguous()
    h = ab.shape[-1] // 2
    y = torch.empty(*ab.shape[:-1], h)
    lib.qk_silu_mul(ab.data_ptr(), ab.numel() // (2 * h), h, y.data_ptr())
    return y


# ====================================================================================== top-k of rows
def topk(x: torch.Tensor, k: int, with_lse: bool = False):
    """(values, indices[, lse]) of the k largest entries of each row of x [..., N] (fp32 CPU, no autograd),
    largest first, ties in index order (the first maximum first, as torch.argmax), NaN above every number;
    lse = logsumexp of each row, so values - lse[..., None] are the top k log-probabilities. One C pass
    (csrc/qkernels.c, qk_topk); None where that does not apply (the caller uses torch.topk)."""
    if not _eligible(x) or x.dim() == 0 or not 1 <= k <= min(64, x.shape[-1]):
        return None
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    N = x.shape[-1]
    M = x.numel() // N
    vals = torch.empty(*x.shape[:-1], k)
    idx = torch.empty(*x.shape[:-1], k, dtype=torch.long)
    lse = torch.empty(x.shape[:-1]) if with_lse else None
    lib.qk_topk(x.data_ptr(), M, N, N, k, vals.data_ptr(), idx.data_ptr(), lse.data_ptr() if with_lse else None)
    return (vals, idx, lse) if with_lse else (vals, idx)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first maximum; NaN above every number), through `topk` where it applies."""
    out = topk(x, 1)
    return x.argmax(-1) if out is None else out[1][..., 0]


# ========================================================================== RoPE + KV-cache store
@_unintercepted
def rope_store(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """For a fused projection qkv [B, T, (H + 2 Hk) d] (contiguous fp32): rotate q in place (RoPE,
    rotate-half), and write rotated k and v to k_cache/v_cache [B, Hk, S_max, d] at slots [B, T]. In a
    torch.compile trace, the custom op midlayer::rope_store (the same C call)."""
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    # reshape/convert only when needed: each costs ~2 us, and this runs once per layer per decode step (a bf16
    # model's tables are bf16: widened exactly, as the kernel reads fp32)
    if cos.shape != (B, T, D) or not cos.is_contiguous() or cos.dtype != torch.float32:
        cos = cos.reshape(B, T, D).float().contiguous()
    if sin.shape != (B, T, D) or not sin.is_contiguous() or sin.dtype != torch.float32:
        sin = sin.reshape(B, T, D).float().contiguous()
    if slots.numel() != B * T:
        raise ValueError(f"{slots.numel()} slots for {B} x {T} rows")
    if qkv.dtype != torch.float32 or not qkv.is_contiguous():
        raise ValueError(f"rope_store rotates a contiguous fp32 qkv in place (got {qkv.dtype}, "
                         f"contiguous={qkv.is_contiguous()})")
    if slots.dtype != torch.long or not slots.is_contiguous():
        slots = slots.to(torch.long).contiguous()
    _kv16(k_cache)  # (a cache the kernels cannot hold is refused here, in a trace too)
    if torch.compiler.is_compiling():
        torch.ops.midlayer.rope_store(qkv, n_heads, n_kv_heads, cos, sin, k_cache, v_cache, slots)
    else:
        _rope_store_c(qkv, n_heads, n_kv_heads, cos, sin, k_cache, v_cache, slots)


def _rope_store_c(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """`rope_store`'s C call, its operands checked and laid out."""
    B, T, _ = qkv.shape
    library().qk_rope_store(qkv.data_ptr(), qkv.stride(0), B, T, n_heads, n_kv_heads, k_cache.shape[-1],
                            cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                            k_cache.stride(0), k_cache.stride(1), slots.data_ptr(), _kv16(k_cache))


# ===================================================================================== attention
# What a KV cache the kernels read and write may hold, in the order of the C calls' `kv16` (its index here)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kv16(k_cache: torch.Tensor) -> int:
    """The C calls' `kv16`: 1 for an fp16 KV cache, 2 for a bf16 one (the kernels round stores to nearest even,
    as torch's casts do, and widen reads exactly), 0 for fp32."""
    if k_cache.dtype not in KV_DTYPES:
        raise ValueError(f"the C kernels keep K/V in fp32, fp16 or bf16, not {k_cache.dtype}")
    return KV_DTYPES.index(k_cache.dtype)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                        ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in fp32: q [B, H, T, d], k/v [B, Hk, S, d], mask [B, 1 or H, T, S]."""
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
    `n_keys` slots are read), mask [B, 1, T, n_keys] additive (or [B, H, T, n_keys]: per-head position
    biases) or None (every key visible). Returns [B, H, T, d] fp32."""
    lib = library()
    if n_keys is not None:
        k, v = k[:, :, :n_keys], v[:, :, :n_keys]
    if (lib is None or q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype not in KV_DTYPES
            or v.dtype != k.dtype):
        return attention_reference(q, k, v, mask)
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if q.stride(-1) != 1 or k.stride() != v.stride() or k.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # The kernel addresses q as (b, t, h): q + b*qb + t*qt + h*D, which needs heads at stride D.
    if q.stride(1) != D:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    m, mh = _mask_for_kernel(mask, B, H, T, S)
    out = torch.empty(B, T, H, D)
    scratch = _workspace(8 * B * T * H * S)  # per row: S scores + S key slots
    lib.qk_attention(_ptr(q), q.stride(0), q.stride(2), _ptr(k), _ptr(v), k.stride(0), k.stride(1), k.stride(2),
                     _ptr(m) if m is not None else None, B, T, H, Hk, S, D, float(D ** -0.5), _ptr(out),
                     _ptr(scratch), mh, _kv16(k))
    return out.transpose(1, 2)


def _mask_for_kernel(mask: torch.Tensor | None, B: int, H: int, T: int, S: int) -> tuple[torch.Tensor | None, int]:
    """(mask as the C kernel reads it: fp32 contiguous [B, MH, T, S], MH): MH = H for a per-head mask, else 1."""
    if mask is None:
        return None, 1
    mh = H if mask.dim() == 4 and mask.shape[1] == H and H > 1 else 1
    if mask.dtype == torch.float32 and mask.shape == (B, mh, T, S) and mask.is_contiguous():
        return mask, mh
    return mask.float().expand(B, mh, T, S).contiguous(), mh


@_unintercepted
def attention_fused(qkv: torch.Tensor, n_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    mask: torch.Tensor | None, n_keys: int) -> torch.Tensor:
    """`attention` for the cached step, straight from the fused projection: the queries are the first
    n_heads * d columns of qkv [B, T, (H + 2 Hk) d] (contiguous fp32, RoPE applied), keys/values the first
    n_keys slots of the cache layers [B, Hk, S_max, d]; mask [B, 1 or H, T, n_keys] or None.
    Returns [B, T, H d]. The same C call and bits as `attention`, without its views and copies (one
    tensor allocated): the decode step calls this once per layer. In a torch.compile trace, the custom op
    midlayer::attention_fused (the same C call: the static step's attention="c" traces whole)."""
    if qkv.dtype != torch.float32 or not qkv.is_contiguous():
        raise ValueError(f"attention_fused reads a contiguous fp32 qkv (got {qkv.dtype}, "
                         f"contiguous={qkv.is_contiguous()})")
    mask, mh = _mask_for_kernel(mask, qkv.shape[0], n_heads, qkv.shape[1], n_keys)
    _kv16(k_cache)
    if torch.compiler.is_compiling():
        return torch.ops.midlayer.attention_fused(qkv, n_heads, k_cache, v_cache, mask, n_keys, mh)
    return _attention_fused_c(qkv, n_heads, k_cache, v_cache, mask, n_keys, mh)


def _attention_fused_c(qkv: torch.Tensor, n_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       mask: torch.Tensor | None, n_keys: int, mh: int) -> torch.Tensor:
    """`attention_fused`'s C call, the mask laid out for it (`_mask_for_kernel`)."""
    B, T, _ = qkv.shape
    Hk, D = k_cache.shape[1], k_cache.shape[3]
    out = torch.empty(B, T, n_heads * D)
    ks = k_cache.stride()
    library().qk_attention(qkv.data_ptr(), qkv.stride(0), qkv.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                           ks[0], ks[1], ks[2], None if mask is None else mask.data_ptr(), B, T, n_heads, Hk,
                           n_keys, D, float(D ** -0.5), out.data_ptr(),
                           _workspace(8 * B * T * n_heads * n_keys).data_ptr(), mh, _kv16(k_cache))
    return out


# The C calls of RoPE with the store and of the cached attention as PyTorch custom ops, as `linear_rows`'s: what
# a torch.compile trace of the static step with attention="c" calls. Registered at import, once a process.
if not hasattr(torch.ops.midlayer, "rope_store"):
    torch.library.custom_op(
        "midlayer::rope_store", _rope_store_c, mutates_args=("qkv", "k_cache", "v_cache"),
        schema="(Tensor(a!) qkv, int n_heads, int n_kv_heads, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
               "Tensor(c!) v_cache, Tensor slots) -> ()").register_fake(lambda *args: None)
    torch.library.custom_op(
        "midlayer::attention_fused", _attention_fused_c, mutates_args=(),
        schema="(Tensor qkv, int n_heads, Tensor k_cache, Tensor v_cache, Tensor? mask, int n_keys, int mh) -> Tensor"
    ).register_fake(lambda qkv, n_heads, k_cache, v_cache, mask, n_keys, mh: qkv.new_empty(
        (qkv.shape[0], qkv.shape[1], n_heads * k_cache.shape[3]), dtype=torch.float32))


# ================================================================================ a whole block
class BlockQ4:
    """What `block_q4` needs of one block that never changes between calls: the weights of a pre-norm or
    sandwich (peri-LN) SwiGLU block in the q4 format -- its RMSNorms (attention_norm, ffn_norm, and the
    sandwich's attention_out_norm, ffn_out_norm, else None) with their one eps, and (codes, scales) of
    wqkv, wo, w13, w2 (Q4_1, `quantize_q4_1`) -- and its sizes. The tensors are held (their memory stays
    valid); their addresses are read at every call, so a copy of the model (deepcopy, pickle) or storage
    moved in place (share_memory_) is followed."""

    def __init__(self, norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], eps: float,
                 linears: tuple[tuple[torch.Tensor, torch.Tensor], ...], n_heads: int) -> None:
        if len(norms) != 4 or len(linears) != 4 or (norms[2] is None) != (norms[3] is None):
            raise ValueError("BlockQ4: 4 norms (the output norms both or neither) and 4 linears")
        tensors = (*norms, *(t for pair in linears for t in pair))
        if any(t is not None and (t.device.type != "cpu" or not t.is_contiguous()) for t in tensors):
            raise ValueError("block_q4 takes contiguous CPU tensors")
        self.tensors = tensors
        self.dim, self.n_heads, self.eps = norms[0].numel(), n_heads, float(eps)
        self.hidden = linears[3][0].shape[1] * QK  # w2's input features


def _block_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor | None, H: int, D: int, n_keys: int) -> tuple:
    """x [B, M, d], cos/sin, slots and mask as qk_block_q4 reads them: contiguous, cos/sin one row of hd per
    (b, m), slots int64, the mask `_mask_for_kernel`'s (with its MH)."""
    B, M = x.shape[:2]
    x = x.contiguous()
    if cos.numel() != B * M * D or not cos.is_contiguous():
        cos = cos.reshape(-1, M, D).expand(B, M, D).contiguous()
    if sin.numel() != B * M * D or not sin.is_contiguous():
        sin = sin.reshape(-1, M, D).expand(B, M, D).contiguous()
    if slots.dtype != torch.long or not slots.is_contiguous():
        slots = slots.to(torch.long).contiguous()
    m, mh = _mask_for_kernel(mask, B, H, M, n_keys)
    return x, cos, sin, slots, m, mh


def block_q4(x: torch.Tensor, plan: BlockQ4, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, n_keys: int) -> torch.Tensor:
    """One pre-norm or sandwich SwiGLU block of the q4 format over the KV cache in ONE C call: x [B, M, d]
    (fp32) -> the residual leaving the block, a new tensor. cos/sin: B * M * hd values, one row of hd per (b, m);
    k_cache/v_cache: the layer's cache [B, Hk, S_max, hd]; slots [B, M]; mask as `attention_fused`.
    Bit-identical to running the block's modules one by one (model.Block._forward_fused; tests/test_kernels.py
    compares them)."""
    lib = library()
    B, M, d = x.shape
    Hk, D = k_cache.shape[1], k_cache.shape[3]
    H = plan.n_heads
    if (d != plan.dim or k_cache.stride(2) != D or k_cache.stride() != v_cache.stride()
            or v_cache.dtype != k_cache.dtype):
        raise ValueError(f"block_q4: x has {d} features (the block {plan.dim}), or the cache is not [B, Hk, S, hd]")
    x, cos, sin, slots, m, mh = _block_inputs(x, cos, sin, slots, mask, H, D, n_keys)
    y = torch.empty(B, M, d)
    work = _workspace(lib.qk_block_q4_work(B * M, d, H, Hk, D, plan.hidden, n_keys))
    ks = k_cache.stride()
    lib.qk_block_q4(x.data_ptr(), y.data_ptr(), B, M, d, H, Hk, D, plan.hidden, plan.eps, D ** -0.5,
                    *[None if t is None else t.data_ptr() for t in plan.tensors], cos.data_ptr(), sin.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), ks[0], ks[1], ks[2], slots.data_ptr(), None if m is None else m.data_ptr(), mh, n_keys,
                    work.data_ptr(), _kv16(k_cache))
    return y


_STACKS: dict[tuple[int, ...], tuple] = {}  # plan ids -> (probe addresses, the C array, weak refs to the plans)


def _stack_pointers(plans: Sequence[BlockQ4]) -> ctypes.Array:
    """The 12 weight addresses of every plan, as one C array; kept per tuple of plans and rebuilt when a
    plan's first weight moved (a copy of the model, storage moved in place)."""
    key = tuple(id(p) for p in plans)
    probe = tuple(p.tensors[4].data_ptr() for p in plans)
    hit = _STACKS.get(key)
    if hit is not None and hit[0] == probe and all(r() is p for r, p in zip(hit[2], plans)):
        return hit[1]  # (the weak references: an id reused by another model's plan is never a hit)
    if len(_STACKS) > 16:
        _STACKS.clear()
    arr = (ctypes.c_void_p * (12 * len(plans)))(*[None if t is None else t.data_ptr() for p in plans
                                                  for t in p.tensors])
    _STACKS[key] = (probe, arr, [weakref.ref(p) for p in plans])
    return arr


def blocks_q4(x: torch.Tensor, plans: Sequence[BlockQ4], cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, first_layer: int, slots: torch.Tensor, mask: torch.Tensor | None, n_keys: int
              ) -> torch.Tensor:
    """`block_q4` for consecutive blocks (plans, all of one model: the same sizes and eps) in ONE C call:
    block i runs over the cache layer first_layer + i of the whole buffers k, v [L, B, Hk, S_max, hd]; the
    rows, positions, slots and mask are the same for all (a forward whose blocks are all dense q4 ones).
    Bit-identical to `block_q4` block by block; without the ~30 us of Python between them."""
    lib = library()
    B, M, d = x.shape
    Hk, D = k.shape[2], k.shape[4]
    p0 = plans[0]
    H = p0.n_heads
    if any(p.dim != d or p.n_heads != H or p.hidden != p0.hidden or p.eps != p0.eps for p in plans):
        raise ValueError("blocks_q4: the blocks differ in size or eps (one model's blocks only)")
    if (k.stride(3) != D or k.stride() != v.stride() or v.dtype != k.dtype
            or not first_layer + len(plans) <= k.shape[0]):
        raise ValueError("blocks_q4: the cache is not [L, B, Hk, S, hd] covering the blocks")
    x, cos, sin, slots, m, mh = _block_inputs(x, cos, sin, slots, mask, H, D, n_keys)
    y, tmp = torch.empty(B, M, d), torch.empty(B, M, d)
    work = _workspace(lib.qk_block_q4_work(B * M, d, H, Hk, D, p0.hidden, n_keys))
    ks = k.stride()
    lib.qk_blocks_q4(x.data_ptr(), y.data_ptr(), tmp.data_ptr(), len(plans), B, M, d, H, Hk, D, p0.hidden, p0.eps,
                     D ** -0.5, _stack_pointers(plans), cos.data_ptr(), sin.data_ptr(),
                     k.data_ptr() + k.element_size() * first_layer * ks[0],
                     v.data_ptr() + v.element_size() * first_layer * ks[0], ks[0], ks[1], ks[2], ks[3],
                     slots.data_ptr(), None if m is None else m.data_ptr(), mh, n_keys, work.data_ptr(), _kv16(k))
    return y


def build_report() -> int:
    """Build the library now (scripts/setup.sh; `midlayer kernels`) and print this CPU's features. 0 when built,
    1 when not (midlayer then runs q4 through PyTorch)."""
    status = 0
    try:
        path = build(verbose=True)
        print(f"built {path}")
    except RuntimeError as e:
        print(f"not built: {e}", file=sys.stderr)
        status = 1
    print(cpu_info().summary())
    return status


if __name__ == "__main__":  # `python -m midlayer.ops.kernels`: exits 1 when not built, as `midlayer kernels`
    sys.exit(build_report())

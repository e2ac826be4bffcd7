"""What the static step's Triton kernels (row_attention.py, row_linear.py, fused_rows.py) share: Triton imported
on first need, a kernel made from a plain function, the bf16 rounding helper, whether a kernel runs on a
device, and a build ahead of time for a GPU that this machine does not have.

Triton is optional (PyTorch's CUDA builds bring it). A CPU run never imports it (0.1 s), except under Triton's
interpreter (TRITON_INTERPRET=1 before triton's import; tests/conftest.py sets it without CUDA), where the same
kernel source runs in numpy: what the tests use to check each kernel against its formula.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

NEEDS = ("the static step's Triton kernels need Triton, and on a CPU Triton's interpreter (TRITON_INTERPRET=1 "
         "before triton is imported; the tests' conftest sets it)")

_modules: tuple | None = None
_loaded = False
_kernels: dict[Callable, object] = {}
_interpreted: dict[Callable, bool] = {}  # fn -> whether its kernel runs in the interpreter (`interpreted`)


def load() -> tuple | None:
    """(triton, triton.language), imported once, or None where Triton does not import."""
    global _modules, _loaded
    if not _loaded:
        _loaded = True
        try:  # optional: PyTorch's CUDA builds bring it
            import triton
            import triton.language as tl
        except Exception:  # (ImportError, or a broken install)
            return None
        _modules = (triton, tl)
    return _modules


def options(**jit_kw) -> Callable[[Callable], Callable]:
    """Declares a kernel function's own options to triton.jit (`do_not_specialize`, ...) where it is defined. A
    kernel is made once, by whichever call needs it first (`runs_on`, a launch), so its options cannot ride a
    call: row_linear's `do_not_specialize=["M"]` once came with its launch, after `available` had made it
    without."""
    def mark(fn: Callable) -> Callable:
        fn.triton_jit = jit_kw
        return fn
    return mark


def kernel(fn: Callable):
    """`fn` made a Triton kernel, once, with the options it declares (`options`); None without Triton. The
    kernel's source names `tl` and its helpers (`helpers`) as globals of its own module, which are set here:
    Triton resolves the names of a kernel's body through the function's globals (under the interpreter, `tl`
    to the interpreter's own). torch.compile traces a launch of a made kernel (a JITFunction) but not its
    making (a graph break): `runs_on` makes a file's kernels before any forward is traced."""
    if fn not in _kernels:
        mods = load()
        if mods is None:
            return None
        triton, lang = mods
        for space in (fn.__globals__, globals()):  # (the kernel's module, and this one's for the helpers)
            space["tl"] = lang
        for name, helper in helpers(fn).items():
            if helper.__name__ != name:  # (Inductor re-emits a helper's source: its `def` must name what is called)
                raise RuntimeError(f"the kernels' helper {helper.__name__} is called {name}: name its def so")
            if helper not in _kernels:
                _kernels[helper] = triton.jit(helper)
            if fn.__globals__.get(name) not in (None, helper, _kernels[helper]):  # (or it replaces the module's own)
                raise RuntimeError(f"{fn.__module__}.{name} is not free for the kernels' helper of that name")
            fn.__globals__[name] = _kernels[helper]
        _kernels[fn] = triton.jit(fn, **getattr(fn, "triton_jit", {}))
        _interpreted[fn] = not isinstance(_kernels[fn], triton.runtime.jit.JITFunction)
    return _kernels[fn]


def helpers(fn: Callable) -> dict[str, Callable]:
    """The device helpers a kernel's body calls, by the names it calls them: the shared ones below (`to_bf16`,
    `swiglu`, `rope`), and those its module declares (`HELPERS`: name -> function)."""
    return {"to_bf16": to_bf16, "swiglu": swiglu, "rope": rope, **fn.__globals__.get("HELPERS", {})}


tl = None  # triton.language once loaded (for the helpers below)


def to_bf16(x):
    """A kernels' helper (bound as `to_bf16` in each kernel's module): fp32 -> bf16 to nearest, ties to even,
    in integer ops, the same bits compiled and in Triton's interpreter (whose own cast truncates). (Not for
    NaN: none of the kernels makes one from finite inputs.)"""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def swiglu(a, b):
    """A kernels' helper (bound as `swiglu`): SwiGLU's silu(a) * b in fp32 (FeedForward's formula), one
    formula for the SwiGLU kernel (fused_rows) and the row-linear kernel's SwiGLU prologue (row_linear), so the
    fused down projection reads the very values the separate kernel would have stored."""
    return a / (1.0 + tl.exp(-a)) * b


def rope(x, p, c, s):
    """A kernels' helper (bound as `rope`): one rotated element x cos + p sin in fp32, p its partner in
    rotate_half(x) = [-x2, x1] (attention.apply_rope; Su et al. 2021, arXiv 2104.09864), one formula
    for the RoPE kernel (fused_rows.rope_store) and the row-linear kernel's RoPE epilogue (row_linear), so the
    two round alike."""
    return x * c + p * s


def runs_on(fns: tuple[Callable, ...], device: torch.device | None = None) -> bool:
    """Whether the kernels made from `fns` (a kernel file's KERNELS, made here all at once) run here: Triton
    imports, and for `device` (when given) they run there (CUDA compiled; a CPU only under the interpreter)."""
    ks = [kernel(fn) for fn in fns]
    return all(k is not None for k in ks) and (device is None or device.type == "cuda" or interpreted(fns[0]))


def interpreted(fn: Callable) -> bool:
    """Whether the kernel made from `fn` runs in Triton's interpreter: a flag kept when `kernel` made it, so that a
    launch traced by torch.compile reads a Python bool (Dynamo in torch 2.11 cannot evaluate an isinstance of a
    Triton kernel: the H200 run's compile rows, 62nd session). False for a kernel not made."""
    return _interpreted.get(fn, False)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, features] with the features contiguous (a view where it can be): what the row-wise kernels
    (fused_rows, row_linear) index by a row stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def pow2(n: int) -> int:
    """The smallest power of two >= n (a Triton block's extent must be one)."""
    return 1 << max(int(n) - 1, 0).bit_length()


# the dtypes every kernel reads and stores (an fp32 or bf16 model; bf16 through `to_bf16`), by Triton's names
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def compile_for(fn: Callable, capability: int, kinds: dict[str, str], constexprs: dict[str, object],
                **options):
    """The kernel of `fn` compiled ahead of time for an NVIDIA GPU of compute capability `capability` (80: A100,
    90: H100 / H200) by Triton's compiler and the ptxas it ships: no GPU needed, so a CPU machine checks that a
    kernel builds for the GPUs it is meant for. kinds: Triton's type of each argument not a 32-bit integer
    ("*fp32", "fp32", "*i64", ...; "constexpr" for those in `constexprs`); options: the launch's (num_warps).
    Returns Triton's compiled kernel (its `asm` holds the PTX and the cubin)."""
    kernel(fn)  # (its module's `tl` set)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    names = list(inspect.signature(fn).parameters)
    jitted = JITFunction(fn, **getattr(fn, "triton_jit", {}))
    src = ASTSource(fn=jitted, signature={n: kinds.get(n, "i32") for n in names},
                    constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options or None)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b): a grid's extent."""
    return -(-a // b)

"""Test-session set-up. Without CUDA, Triton (where installed) must run its kernels in its interpreter, and
that is decided when triton is first imported: tests/test_row_attention.py runs the row-attention kernel so."""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _patch_device_functions_once() -> None:
    """Triton's interpreter re-patches triton.language (inspect.getmembers over its modules) at every call of a
    device function -- every tl.sum, tl.max, tl.argmax and our to_bf16, once per program of every launch --
    and drops that patch's scope (triton 3.x, runtime/interpreter.py: `InterpretedFunction.__call__`). Every
    launch patches the same language first (and restores it after), so inside a launch the repeats change
    nothing and only cost time: about a fifth of a kernel test's. The patch of the modules a device function
    alone names (triton.language.core, for the standard library's reductions) stays from its first call, as
    nothing restores it. This makes each device function patch once. A wrong skip could not change a result
    silently: an unpatched builtin raises. Where Triton's interpreter is not laid out so, nothing is changed."""
    import inspect
    import re
    import sys

    try:
        from triton.runtime import interpreter
    except Exception:
        return
    real, device_fn = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "InterpretedFunction", None)
    try:  # (the device call must drop its patch's scope: `_patch_lang(self.fn)` as a statement of its own)
        dropped = re.search(r"^\s*_patch_lang\(self\.fn\)\s*$", inspect.getsource(device_fn.__call__), re.M)
    except Exception:
        dropped = None
    if real is None or dropped is None:
        return
    done: set = set()

    def patch_lang(fn):
        if isinstance(sys._getframe(1).f_locals.get("self"), device_fn):  # a device function's call
            if fn in done:
                return None  # (its caller drops the scope: nothing would restore it)
            done.add(fn)
        return real(fn)

    interpreter._patch_lang = patch_lang


def _skip_unasserted_overflow_checks() -> None:
    """Triton's interpreter checks every 32-bit integer add, sub and mul for overflow (its options'
    `sanitize_overflow`, on by default: the operands widened to int64, the op done again, two comparisons) and
    hands the result to `device_assert`, which drops it unless the options' `debug` is on (it is off): the
    check can never fail, and it took about half the interpreter's time in a step test (cProfile of
    test_device_rounds_through_the_triton_kernels_are_lossless[hidden-transfer]); without it
    test_a_row_kernel_off_the_formula_takes_the_attention_kernel_down_with_it took 29 s where it took 44 (alone,
    on 2 cores). A compiled kernel does not check either, unless built with debug. This turns the check off wherever debug is off, so nothing that
    could be reported is lost. Where the interpreter is not laid out so, nothing is changed."""
    import dataclasses

    try:
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder  # (the one builder every interpreted launch uses)
        if not builder.options.debug:
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except Exception:
        return


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_device_functions_once()
    _skip_unasserted_overflow_checks()


def _threads_per_worker() -> None:
    """Under pytest-xdist (`-n N`), each of the N worker processes takes its share of the cores for PyTorch's
    intra-op threads, not all of them: N workers each running as many threads as there are cores oversubscribe
    them (on 2 cores, `-n 2` with 2 threads each ran the suite a third slower than one process). The processes
    a test starts (the kill tests', the CLI's, the gloo ranks') inherit the share through OMP_NUM_THREADS,
    unless it is set already: with all the cores each, they contended with the other workers (on 2 cores with
    `-n 2`, tests/test_kill.py's three tests took 60, 56 and 46 s so, against 133, 81 and 65 s before)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = max(1, cores // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


_threads_per_worker()

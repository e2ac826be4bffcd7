"""The few helpers every layer needs, at the bottom of the package so that anything may import them: the one
atomic file write, the one file hash, midlayer's cache folder, JSON without NaN, the rules for integer and
real settings, and the dtype / autocast choice of a device.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import operator
import os
import uuid
from pathlib import Path
from typing import Any, Callable, ContextManager

import numpy as np
import torch


def atomic_write(path: str | Path, *chunks: bytes | np.ndarray, writer: Callable[[Path], None] | None = None
                 ) -> None:
    """Write `path` whole or not at all: into a uniquely named temporary file beside it, fsync, then rename.

    The data are `chunks` (bytes or arrays, written one by one: no concatenated copy of a 100M-token shard),
    or what `writer(tmp_path)` writes (torch.save, safetensors). A unique temporary name (pid and a random
    tag) makes concurrent writers of the same bytes safe, e.g. every data-parallel rank preparing one cache;
    `open(..., "xb")` rather than mkstemp so the file gets the usual umask permissions, not 0600. A failed
    write (a full disk: torch.save reports it as a RuntimeError from its zip writer) is an OSError naming the
    file; the temporary file is removed and an earlier `path` stays as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        if writer is not None:
            writer(tmp)
        else:
            with open(tmp, "xb") as f:
                for c in chunks:
                    f.write(memoryview(c).cast("B") if isinstance(c, np.ndarray) else c)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise OSError(f"writing {path} failed ({first}); a full disk? The earlier {path.name}, if any, is "
                      "intact") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes: what every verified cache and artifact records (shards, the kernel
    library, drafts' weights)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_dir() -> Path:
    """midlayer's on-disk cache (compiled kernels, tokenized corpora, row-cost curves, GGUF indexes):
    $MIDLAYER_CACHE or ~/.cache/midlayer."""
    root = os.environ.get("MIDLAYER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "midlayer")
    return Path(root)


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN or infinity replaced by None (JSON null): `json.dumps` would write the tokens
    NaN / Infinity, which are not JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def as_integer(x: object) -> int | None:
    """`x` as a Python int where it is an integer -- Python's, numpy's, a 0-d integer tensor or array -- but not a
    bool of any kind (True is no token budget), not a float even a whole one, not a tensor of several elements;
    else None. The one rule for integer settings (the API's and generation's)."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (torch.Tensor, np.ndarray)):
        whole = x.dtype.kind in ("i", "u") if isinstance(x, np.ndarray) else x.dtype in _INT_DTYPES
        return int(x.item()) if x.ndim == 0 and whole else None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_real(x: object) -> float | None:
    """`x` as a Python float where it is a real number -- Python's or numpy's int or float, a 0-d integer or
    floating tensor or array -- not a bool of any kind; else None. The rule for real-valued settings, beside
    `as_integer`."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (torch.Tensor, np.ndarray)):
        if isinstance(x, np.ndarray):
            real = x.dtype.kind in ("i", "u", "f")
        else:
            real = x.dtype in _INT_DTYPES or x.dtype.is_floating_point
        return float(x.item()) if x.ndim == 0 and real else None
    return float(x) if isinstance(x, numbers.Real) else None


_INT_DTYPES = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA runs them asynchronously: a timer must time them, not their
    launch); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A config's dtype name ("auto", "float32", "bfloat16") on `device`: auto is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def autocast_context(device: torch.device, dtype: torch.dtype, enabled: bool = True) -> ContextManager:
    """Autocast to `dtype` on `device`, or nothing for fp32 (or when not `enabled`)."""
    if dtype == torch.float32 or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)

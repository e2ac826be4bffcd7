"""Caches are verified, never trusted (issue 43): the compiled kernel library is loaded only when the record
written after its build vouches for its bytes and its source. An empty, truncated or replaced library, or
one built from other source, is rebuilt (with a note), never loaded: a truncated one used to kill the
process with SIGBUS, and an empty one to send every q4 call down another path with other tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from midlayer.ops import kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of its own holding an intact library and its record: copied from the session's cache
    when that one is intact (a build costs ~12 s on 2 cores), else built there."""
    if kernels._compiler() is None:
        pytest.skip("no C compiler to build the kernels with")
    have = kernels.library_path()
    monkeypatch.setenv("MIDLAYER_CACHE", str(tmp_path))
    out = kernels.library_path()
    if have.exists() and kernels.cached_library_problem(have) is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(have, out)
        shutil.copyfile(have.with_name(have.name + ".json"), out.with_name(out.name + ".json"))
    assert kernels.build() == out
    return out, out.read_bytes()


def _compile_by_copy(good: bytes, calls: list) -> Callable:
    """A stand-in for `kernels.compile_library` that writes the intact library's bytes: what `build` decides,
    writes and records is under test here; a real compile is (the fresh process below, test_kernels)."""
    def compile_library(src: Path, out: Path) -> list[str]:
        calls.append(out)
        out.write_bytes(good)
        return ["cc", "-o", str(out), str(src), "-lm"]
    return compile_library


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped byte", "no record", "other source",
                                    "unreadable record"])
def test_a_damaged_library_is_named_and_never_trusted(cache, damage, monkeypatch):
    out, good = cache
    calls: list = []
    monkeypatch.setattr(kernels, "compile_library", _compile_by_copy(good, calls))
    assert kernels.cached_library_problem(out) is None
    assert kernels.build() == out and calls == []  # an intact library is not compiled again
    rec = out.with_name(out.name + ".json")
    if damage == "empty":
        out.write_bytes(b"")
    elif damage == "truncated":
        out.write_bytes(good[:len(good) // 2])
    elif damage == "flipped byte":
        out.write_bytes(good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])
    elif damage == "no record":
        rec.unlink()
    elif damage == "other source":
        rec.write_text(json.dumps({**json.loads(rec.read_text()), "source_sha256": "0" * 64}))
    else:
        rec.write_bytes(b"\xff\x00 not json")
    assert kernels.cached_library_problem(out) is not None
    with pytest.warns(RuntimeWarning, match="rebuilding the kernel library"):
        assert kernels.build() == out
    assert len(calls) == 1 and calls[0] != out  # compiled once, into a file of its own, then moved in place
    assert kernels.cached_library_problem(out) is None and out.read_bytes() == good


def test_a_truncated_library_is_rebuilt_in_a_fresh_process_not_loaded(cache):
    """The case that killed `generate` and `train` with SIGBUS (exit 135): a new process rebuilds instead."""
    out, good = cache
    out.write_bytes(good[:len(good) // 3])
    res = subprocess.run([sys.executable, "-c", "from midlayer import kernels; print(kernels.available())"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0 and res.stdout.strip() == "True", (res.returncode, res.stderr[-500:])
    assert "rebuilding the kernel library" in res.stderr
    assert kernels.cached_library_problem(out) is None


def test_a_cached_shard_changed_in_place_is_rebuilt_not_used(tmp_path):
    """One token of the cached validation shard changed, same size (issue 43: the CE moved, nothing was said):
    the cache is rebuilt, with a note, and gives the original tokens again."""
    from midlayer.data.shards import prepare_corpus, read_shard

    docs = [(f"doc{i}", f"Some text number {i}. " * 40) for i in range(30)]
    files = prepare_corpus(tmp_path, 300, documents=docs, name="t")
    val = files.val[0]
    good = np.asarray(read_shard(val)).copy()
    data = bytearray(val.read_bytes())
    data[-2] ^= 1  # one bit of the last token
    val.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="rebuilding the cached shards"):
        again = prepare_corpus(tmp_path, 300, documents=docs, name="t")
    assert np.array_equal(np.asarray(read_shard(again.val[0])), good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact cache: no note, no rebuild
        prepare_corpus(tmp_path, 300, documents=docs, name="t")


def test_training_never_builds_or_loads_the_kernels(tmp_path):
    """`train` (and the evaluation inside it) does not need the C kernels, so it neither builds nor loads them:
    a damaged library cannot touch it. Inference (compress_weights) takes them where they apply."""
    from midlayer.data.shards import write_shard

    toks = np.random.default_rng(0).integers(0, 512, 6_000)
    d = tmp_path / "shards"
    d.mkdir()
    write_shard(d / "syn_train_000.bin", toks[:5_000])
    write_shard(d / "syn_val_000.bin", toks[5_000:])
    cache = tmp_path / "cache"
    code = ("import sys; from midlayer.cli import main; rc = main(sys.argv[1:]); "
            "import midlayer.ops.kernels as k; print('loaded' if k._lib is not None or k._lib_error else 'untouched'); "
            "sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code, "train", "debug", "--data", str(d / "*.bin"), "--steps", "2",
                          "--no-progress", "--out-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "MIDLAYER_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr[-1000:]
    assert res.stdout.strip().splitlines()[-1] == "untouched"
    assert not list(cache.glob("qkernels-*"))

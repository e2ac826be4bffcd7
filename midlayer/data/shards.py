"""Token shards on disk and the one reader used for every corpus.

Shard format (the llm.c / modded-nanogpt `.bin` format, so the published pre-tokenized FineWeb10B GPT-2
shards can be used as they are): a header of 256 little-endian int32, `header[0] = 20240520` (magic),
`header[1] = 1` (version), `header[2] = number of tokens`, the rest zero; then the tokens as little-endian
uint16. Any vocabulary up to 65536 tokens fits.

Reading (`TokenWindows`) has two modes:

* `batch(step, seed, global_batch, start, count)`: random training windows that are a pure function of
  `(seed, step)`. The whole global batch of `global_batch` windows for optimizer step `step` is drawn from
  `np.random.default_rng([seed, step])`; a call returns sequences `start .. start+count-1` of it. Hence:
  resuming needs only the step number (no sampler state in checkpoints), and one process with gradient
  accumulation sees exactly the same sequences as N data-parallel ranks: rank r, micro-step m just asks for
  its own `start` (e.g. `(m * world_size + r) * micro_batch`) of the same global batch. The batch also
  depends on the shard list (order and lengths) and seq_len, and on NumPy's PCG64 `Generator.integers`
  stream, which NumPy keeps stable in practice but does not formally promise across versions
  (tests/test_data.py pins a few values so a change is caught).
* `sequential(batch_size, max_tokens, rank, world_size)`: every target token once, in order, for
  evaluation.

`prepare_corpus` turns the embedded Shakespeare corpus into shards (cached), `resolve_data` maps the
`--data` / `--val-data` command-line values to shard lists.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from midlayer.common import atomic_write, file_sha256
from .corpus import corpus_documents, corpus_fingerprint, split_documents
from .tokenizer import eot_id, load_or_train_tokenizer, TOKENIZER_FILE

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKEN = 65535  # uint16
# bump to invalidate prepared-corpus caches when the preparation changes (2: "<|endoftext|>" written in a
# document is text, not a separator)
_PREP_VERSION = 2

PathLike = str | os.PathLike


# ----------------------------------------------------------------------------------------------- shards


def write_shard(path: PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` (1-D, integer, each in [0, 65535]) as a `.bin` shard at `path`.

    Written to a temporary file in the same folder and renamed into place, so a crash never leaves a
    half-written shard under the final name (a reader would otherwise see a valid-looking prefix).
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"write_shard {path}: tokens must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"write_shard {path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size >= 2**31:
        raise ValueError(f"write_shard {path}: {arr.size} tokens do not fit the int32 token count of the header")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN:
            bad = hi if hi > MAX_TOKEN else lo
            raise ValueError(
                f"write_shard {path}: token id {bad} does not fit uint16 (ids must be in [0, {MAX_TOKEN}]); "
                "the .bin format cannot store vocabularies larger than 65536"
            )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, arr.size
    atomic_write(path, header, np.ascontiguousarray(arr, dtype="<u2"))



def read_shard(path: PathLike) -> np.memmap:
    """Memory-map the tokens of a `.bin` shard (read-only uint16), after checking its header and size.

    Memory-mapping keeps multi-GB corpora off the heap and shares pages between data-parallel processes.
    Refuses (ValueError naming the file) a file shorter than the header, a wrong magic or version, and a
    file whose size disagrees with the header's token count (truncated download or trailing garbage).
    """
    path = Path(path)
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte .bin shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ValueError(f"{path}: bad magic number {int(header[0])} (expected {MAGIC}); not a llm.c/modded-nanogpt "
                         ".bin token shard")
    if header[1] != VERSION:
        raise ValueError(f"{path}: unsupported shard version {int(header[1])} (expected {VERSION})")
    n = int(header[2])
    expected = HEADER_BYTES + 2 * n
    if n < 0 or size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ValueError(f"{path}: file is {what}: header says {n} tokens, i.e. {expected} bytes, but the file has "
                         f"{size} bytes")
    if n == 0:  # mmap cannot map zero bytes; an empty read-only array behaves the same for callers
        return np.memmap(path, dtype="<u2", mode="r", offset=0, shape=(HEADER_INTS * 2,))[:0]
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


def largest_token(path: PathLike, cache_dir: Path | None = None) -> int:
    """The largest token id in a `.bin` shard (-1 when empty): one pass over it, remembered in `cache_dir`
    (keyed by the file's absolute path, size and modification time) so that a corpus of many large shards is
    read once, not at every start."""
    path = Path(path)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = Path(cache_dir) / "shard-max" / f"{key}.json" if cache_dir is not None else None
    if memo is not None and memo.is_file():
        try:
            return int(json.loads(memo.read_text())["max"])
        except (ValueError, KeyError, TypeError):
            pass  # (a damaged memo: read the shard again)
    tokens = read_shard(path)
    top = int(tokens.max()) if len(tokens) else -1
    if memo is not None:
        atomic_write(memo, json.dumps({"max": top, "shard": str(path)}).encode())
    return top


def check_vocabulary(paths: Sequence[PathLike], vocab_size: int, cache_dir: Path | None = None) -> None:
    """Refuse (ValueError naming the shard and --vocab-size) shards holding a token id the model has no embedding
    for: found before training, not at the step whose batch happens to sample it (on CUDA, where the model's own
    range check is off, never)."""
    for p in paths:
        top = largest_token(p, cache_dir)
        if top >= vocab_size:
            raise ValueError(f"{p} holds token id {top}, but --vocab-size is {vocab_size}: give the vocabulary of "
                             "the tokenizer that made the shards (GPT-2's FineWeb shards: 50257)")


# ---------------------------------------------------------------------------------------------- reader


class TokenWindows:
    """Windows of `seq_len + 1` tokens from memory-mapped shards, as (x, y) int64 tensors with y = x shifted by 1.

    No window crosses a shard boundary: consecutive shards are usually unrelated text, and a window that
    spans two would teach the model to continue one document with an arbitrary other one.
    """

    def __init__(self, paths: Sequence[PathLike], seq_len: int, span: tuple[float, float] = (0.0, 1.0)) -> None:
        """`span` = (lo, hi): only tokens [lo n, hi n) of each shard of n tokens, e.g. (0, 0.98) for training and
        (0.98, 1) for a part of the training data that is never trained on (the sparsity controller's
        held-out statistics, `TrainConfig.control_holdout`)."""
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"TokenWindows: seq_len must be a positive int, got {seq_len!r}")
        lo, hi = (float(v) for v in span)
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"TokenWindows: span must satisfy 0 <= lo < hi <= 1, got {span!r}")
        if isinstance(paths, (str, os.PathLike)):
            raise ValueError(f"TokenWindows: paths must be a list of shard paths, got the single path {paths!r}; "
                             "use resolve_data() to expand a glob")
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("TokenWindows: empty list of shard paths (did a glob match nothing?)")
        self.seq_len = seq_len
        self.shards = [read_shard(p) for p in self.paths]
        if (lo, hi) != (0.0, 1.0):  # views of the memory maps, nothing copied
            self.shards = [s[int(lo * len(s)):int(hi * len(s))] for s in self.shards]
        part = "" if (lo, hi) == (0.0, 1.0) else f" (its part {lo:g}-{hi:g})"
        for p, s in zip(self.paths, self.shards):
            if len(s) < seq_len + 1:
                raise ValueError(f"{p}: shard{part} has {len(s)} tokens, fewer than seq_len + 1 = {seq_len + 1} "
                                 "needed for one window; use a shorter seq_len or merge it into another shard")
        # Random mode: window start positions per shard (a window at s uses tokens s .. s+seq_len).
        self._n_starts = np.array([len(s) - seq_len for s in self.shards], dtype=np.int64)
        self._cum_starts = np.cumsum(self._n_starts)
        # Sequential mode: non-overlapping targets, stride seq_len (neighbours share one boundary token).
        self._n_seq = np.array([(len(s) - 1) // seq_len for s in self.shards], dtype=np.int64)
        self._cum_seq = np.cumsum(self._n_seq)

    @property
    def num_tokens(self) -> int:
        """Total tokens over all shards."""
        return int(sum(len(s) for s in self.shards))

    @property
    def num_sequential_windows(self) -> int:
        """Number of windows `sequential` yields over all ranks with max_tokens=0."""
        return int(self._cum_seq[-1])

    def _gather(self, shard_idx: np.ndarray, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.seq_len + 1
        buf = np.empty((len(offsets), L), dtype=np.int64)
        for i, (s, o) in enumerate(zip(shard_idx.tolist(), offsets.tolist())):
            buf[i] = self.shards[s][o:o + L]
        w = torch.from_numpy(buf)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def offsets(self, step: int, seed: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, start offset) of each of the `global_batch` windows of step `step`: a pure function.

        Every valid window position in the data is equally likely, i.e. a shard is picked with probability
        proportional to its number of window positions (its length minus seq_len) and the start is uniform
        within it, so windows never cross shard boundaries. Sampling is with replacement.
        """
        for name, v in (("step", step), ("seed", seed)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TokenWindows.batch: {name} must be a non-negative int, got {v!r}")
        if not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"TokenWindows.batch: global_batch must be a positive int, got {global_batch!r}")
        rng = np.random.default_rng([int(seed), int(step)])
        g = rng.integers(0, int(self._cum_starts[-1]), size=int(global_batch), dtype=np.int64)
        shard_idx = np.searchsorted(self._cum_starts, g, side="right")
        before = np.concatenate([[0], self._cum_starts[:-1]])
        return shard_idx, g - before[shard_idx]

    def batch(self, step: int, seed: int, global_batch: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences `start .. start+count-1` of the global batch for optimizer step `step`, as (x, y) [count, seq_len].

        The global batch depends only on (seed, step, global_batch), never on how many processes or
        micro-batches split it, which is what makes resume exact and 1 process == N data-parallel ranks.
        """
        if not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"TokenWindows.batch: global_batch must be a positive int, got {global_batch!r}")
        if not isinstance(start, (int, np.integer)) or not isinstance(count, (int, np.integer)) or start < 0 \
                or count < 1 or start + count > global_batch:
            raise ValueError(f"TokenWindows.batch: need 0 <= start and 1 <= count with start + count <= global_batch="
                             f"{global_batch}, got start={start!r}, count={count!r}")
        shard_idx, offs = self.offsets(step, seed, global_batch)
        sl = slice(int(start), int(start) + int(count))
        return self._gather(shard_idx[sl], offs[sl])

    def sequential(self, batch_size: int, max_tokens: int = 0, rank: int = 0,
                   world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Non-overlapping windows in order (shard by shard), batched, for evaluation.

        Window k starts at k * seq_len within its shard, so consecutive windows share one boundary token and
        every token except each shard's first (and a tail shorter than seq_len) is a target exactly once.
        `max_tokens` > 0 keeps the first `max_tokens // seq_len` windows (the same windows for any world size);
        0 keeps all. Window i goes to rank `i % world_size`, so ranks can hold one window fewer than others:
        sum loss * tokens locally and all-reduce once at the end rather than per batch. The last batch may be
        smaller than `batch_size`.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"TokenWindows.sequential: batch_size must be a positive int, got {batch_size!r}")
        # Arguments are checked here, when called, not on the first next() of a generator.
        return self._sequential(self.sequential_windows(max_tokens, rank, world_size), batch_size)

    def sequential_windows(self, max_tokens: int = 0, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """The indices of the windows `sequential` gives `rank`, in order (arguments as there)."""
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"TokenWindows.sequential: max_tokens must be an int >= 0 (0 = all), got {max_tokens!r}")
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"TokenWindows.sequential: need 0 <= rank < world_size, got rank={rank!r}, "
                             f"world_size={world_size!r}")
        total = self.num_sequential_windows
        if max_tokens:
            if max_tokens < self.seq_len:
                raise ValueError(f"TokenWindows.sequential: max_tokens={max_tokens} is less than one window of "
                                 f"seq_len={self.seq_len} tokens")
            total = min(total, max_tokens // self.seq_len)
        return np.arange(rank, total, world_size, dtype=np.int64)

    def _sequential(self, mine: np.ndarray, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        before = np.concatenate([[0], self._cum_seq[:-1]])
        for i in range(0, len(mine), batch_size):
            idx = mine[i:i + batch_size]
            shard_idx = np.searchsorted(self._cum_seq, idx, side="right")
            yield self._gather(shard_idx, (idx - before[shard_idx]) * self.seq_len)


# -------------------------------------------------------------------------------------------- corpora


@dataclass
class CorpusFiles:
    """Shards of a corpus and how they were tokenized.

    `tokenizer_path`, `vocab_size` and `eot_id` are None for user-supplied `.bin` globs, whose tokenizer
    midlayer does not know (the published FineWeb shards are GPT-2: vocab 50257, EOT 50256).
    """

    train: list[Path]
    val: list[Path]
    tokenizer_path: Path | None = None
    vocab_size: int | None = None
    eot_id: int | None = None
    info: dict = field(default_factory=dict)


def _progress(total: int, desc: str):
    """A tqdm bar that only appears after 2 s (cached or small runs stay quiet); None if tqdm is absent."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return None
    return tqdm(total=total, desc=desc, delay=2.0, file=sys.stderr, unit="doc")


_ENCODE_CHUNK = 8  # documents per encode_batch call: parallel encoding, progress updates every chunk


def prepare_corpus(cache_dir: Path, vocab_size: int = 4096,
                   documents: Sequence[tuple[str, str]] | None = None, name: str = "shakespeare") -> CorpusFiles:
    """Tokenize the embedded corpus into one train and one val shard, cached under `cache_dir`.

    The tokenizer is trained on the training split only (so validation loss is honest) and cached by
    `midlayer.data.tokenizer`; the shards go to `cache_dir/<name>-v<vocab>-<key>/` where key hashes both splits'
    fingerprints, so a second call with the same data is a cache hit (milliseconds) and different data or
    vocab never reuses stale shards. Each document is followed by the EOT token.

    `documents` overrides the embedded corpus (list of (name, text), split with `split_documents`); it exists
    for tests and for users with their own small text collections.
    """

    docs = corpus_documents() if documents is None else list(documents)
    train_docs, val_docs = split_documents(docs)
    fp_train, fp_val = corpus_fingerprint(train_docs), corpus_fingerprint(val_docs)
    key = hashlib.sha256(f"{_PREP_VERSION}:{fp_train}:{fp_val}:{vocab_size}".encode()).hexdigest()[:16]
    out = Path(cache_dir) / f"{name}-v{vocab_size}-{key}"
    train_path, val_path = out / f"{name}_train_000000.bin", out / f"{name}_val_000000.bin"
    manifest_path = out / "manifest.json"

    tok = load_or_train_tokenizer(out, vocab_size, (t for _, t in train_docs), fp_train)
    eot = eot_id(tok)
    if manifest_path.exists():
        # trusted only if the manifest vouches for every byte: the shards' and the tokenizer's checksums (a
        # shard with one token changed in place, same size, was used as it was: issue 43)
        why = "its manifest is unreadable"
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            sizes_ok = all(p.exists() and os.path.getsize(p) == HEADER_BYTES + 2 * manifest[f"{s}_tokens"]
                           for s, p in (("train", train_path), ("val", val_path)))
            sums_ok = sizes_ok and all(manifest.get(f"{s}_sha256") == file_sha256(p)
                                       for s, p in (("train", train_path), ("val", val_path)))
            if sums_ok and manifest.get("tokenizer_sha256") == file_sha256(out / TOKENIZER_FILE):
                return CorpusFiles([train_path], [val_path], out / TOKENIZER_FILE, tok.get_vocab_size(), eot, manifest)
            why = ("its manifest predates shard checksums" if "train_sha256" not in manifest else
                   "a shard or the tokenizer is not what its manifest records")
        except (OSError, ValueError, KeyError, TypeError):
            pass
        warnings.warn(f"rebuilding the cached shards in {out}: {why}", RuntimeWarning, stacklevel=2)
    t0 = time.perf_counter()
    counts = {}
    tok.encode_special_tokens = True  # "<|endoftext|>" written in a document is its text: the EOT is ours alone
    for split, split_docs, path in (("train", train_docs, train_path), ("val", val_docs, val_path)):
        parts = []
        bar = _progress(len(split_docs), f"tokenizing {name} {split}")
        for i in range(0, len(split_docs), _ENCODE_CHUNK):
            chunk = split_docs[i:i + _ENCODE_CHUNK]
            for enc in tok.encode_batch([t for _, t in chunk]):  # encode_batch uses all cores
                parts.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        tokens = np.concatenate(parts)
        write_shard(path, tokens)
        counts[split] = len(tokens)
    manifest = {
        "name": name, "vocab_size": vocab_size, "actual_vocab_size": tok.get_vocab_size(), "eot_id": eot,
        "train_fingerprint": fp_train, "val_fingerprint": fp_val,
        "train_documents": [n for n, _ in train_docs], "val_documents": [n for n, _ in val_docs],
        "train_tokens": counts["train"], "val_tokens": counts["val"],
        "train_chars": sum(len(t) for _, t in train_docs), "val_chars": sum(len(t) for _, t in val_docs),
        "tokenizer_sha256": file_sha256(out / TOKENIZER_FILE), "seconds": round(time.perf_counter() - t0, 3),
        "train_sha256": file_sha256(train_path), "val_sha256": file_sha256(val_path),
    }
    atomic_write(manifest_path, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    return CorpusFiles([train_path], [val_path], out / TOKENIZER_FILE, tok.get_vocab_size(), eot, manifest)



def _expand(spec: str, what: str) -> list[Path]:
    """Sorted files matching a glob; a directory means all its `.bin` files. Refuses an empty match."""
    spec = os.path.expanduser(spec)
    pattern = os.path.join(spec, "*.bin") if os.path.isdir(spec) else spec
    files = sorted(Path(p) for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise ValueError(f"{what}: {spec!r} matches no files")
    return files


def resolve_data(spec: str, cache_dir: Path, vocab_size: int = 4096, val_spec: str = "") -> CorpusFiles:
    """Turn `--data` / `--val-data` values into shard lists.

    * `spec == "shakespeare"`: the embedded corpus, via `prepare_corpus(cache_dir, vocab_size)`.
    * otherwise `spec` is a glob of `.bin` shards (or a folder: its `*.bin`), sorted by name:
      - with `val_spec`: validation = files matching `val_spec`; training = files matching `spec` that
        are not validation files (so `spec="data/*.bin", val_spec="data/*val*.bin"` works);
      - without `val_spec`: files whose name (not folder) contains "val" are validation, the rest
        training; this matches the published `fineweb_val_000000.bin` / `fineweb_train_*.bin` layout.
      Raises ValueError if either list ends up empty. `vocab_size` is unused for `.bin` shards.
    """
    if spec == "shakespeare":
        if val_spec:
            raise ValueError(f"data: val_data={val_spec!r} is only used with a glob of .bin shards; the embedded "
                             "'shakespeare' corpus has a fixed validation split")
        return prepare_corpus(Path(cache_dir), vocab_size)
    files = _expand(spec, "data")
    if val_spec:
        val = _expand(val_spec, "val_data")
        val_set = {p.resolve() for p in val}
        train = [p for p in files if p.resolve() not in val_set]
    else:
        val = [p for p in files if "val" in p.name]
        train = [p for p in files if "val" not in p.name]
        if not val:
            raise ValueError(f"data: no validation shards among the {len(files)} files matching {spec!r} (no file "
                             "name contains 'val'); pass val_data, a glob of validation shards")
    if not train:
        raise ValueError(f"data: every file matching {spec!r} is a validation shard; no training shards left")
    return CorpusFiles(train, val)


__all__ = ["MAGIC", "VERSION", "HEADER_INTS", "write_shard", "read_shard", "TokenWindows", "CorpusFiles",
           "prepare_corpus", "resolve_data"]

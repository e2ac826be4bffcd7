"""Download and tokenize FineWeb (the paper's data) into `.bin` shards. Needs internet and `midlayer[fineweb]`.

Streams `HuggingFaceFW/fineweb`, config `sample-10BT` (about 10B GPT-2 tokens), with `datasets`
(streaming, so no 30 GB parquet download sits on disk), tokenizes each document with tiktoken's "gpt2"
encoding with the end-of-text token 50256 *before* it, and writes shards of `--shard-tokens` tokens
(default 100M) with `midlayer.data.write_shard`. Shard 0 is the validation split and is named
`fineweb_val_000000.bin`, later ones `fineweb_train_000001.bin`, ... -- the same layout, token order and
format as the published pre-tokenized FineWeb10B GPT-2 shards, so those can be dropped into the same
folder instead. Documents run on across shard boundaries (the reader never crosses one).

Usage: `midlayer data fineweb --out-dir data/fineweb10B --max-tokens 1000000000`, then train with
`--data 'data/fineweb10B/*.bin'` (validation shards are found by "val" in their name).

The pieces that need no internet (`tokenize_documents`, `write_shards`) are separate so they can be tested.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from midlayer.data.shards import MAX_TOKEN, write_shard

DATASET = "HuggingFaceFW/fineweb"
CONFIG = "sample-10BT"
GPT2_EOT = 50256
DEFAULT_SHARD_TOKENS = 100_000_000
_INSTALL_HINT = "pip install 'midlayer[fineweb]'  (or: pip install datasets tiktoken)"


def tokenize_documents(texts: Iterable[str], encode: Callable[[str], list[int]], eot: int) -> Iterator[np.ndarray]:
    """Yield one uint16 array per text: `[eot] + encode(text)`.

    The EOT goes before each document (as in the published shards), so every document, including the
    first of a shard, starts right after a separator. Raises ValueError for ids that do not fit uint16.
    """
    _check_eot(eot)  # eagerly: the generator below would only complain on first use
    return _with_eot((encode(t) for t in texts), eot)


def _check_eot(eot: int) -> None:
    if not isinstance(eot, (int, np.integer)) or not 0 <= eot <= MAX_TOKEN:
        raise ValueError(f"tokenize_documents: eot={eot!r} must be an int in [0, {MAX_TOKEN}] (uint16 .bin format)")


def _with_eot(id_lists: Iterable[list[int]], eot: int) -> Iterator[np.ndarray]:
    _check_eot(eot)
    for i, ids in enumerate(id_lists):
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() > MAX_TOKEN):
            raise ValueError(f"tokenize_documents: document {i} has token ids outside [0, {MAX_TOKEN}]; the encoder's "
                             "vocabulary is too large for the uint16 .bin format")
        out = np.empty(a.size + 1, dtype=np.uint16)
        out[0] = eot
        out[1:] = a
        yield out


def _parallel_encode(pool, texts: Iterable[str], num_proc: int) -> Iterator[list[int]]:
    """Encode in order with a process pool, `chunk` documents at a time.

    Pool.imap would read the whole (endless) input stream into its task queue; fixed-size chunks keep
    memory bounded, and map keeps document order so the shards do not depend on --num-proc.
    """
    it = iter(texts)
    while True:
        block = list(itertools.islice(it, 256 * num_proc))
        if not block:
            return
        yield from pool.map(_gpt2_encode, block, chunksize=64)


def shard_name(prefix: str, index: int) -> str:
    """`<prefix>_val_000000.bin` for shard 0, `<prefix>_train_%06d.bin` for the others (published layout)."""
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def write_shards(token_arrays: Iterable[np.ndarray], out_dir: str | os.PathLike, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 prefix: str = "fineweb", max_tokens: int = 0) -> list[Path]:
    """Pack a stream of token arrays into `.bin` shards of exactly `shard_tokens` tokens (the last may be shorter).

    Shard 0 is validation (see `shard_name`). Arrays are split across shard boundaries so every shard but
    the last is full. `max_tokens` > 0 stops after that many tokens in total (the last document is cut).
    Returns the paths written, in order. Memory: one shard buffer (2 bytes per token). A folder that holds
    `<prefix>_*.bin` shards already is refused: a smaller run over a bigger one left its later shards, and
    training read them as this run's. An id outside uint16 is a ValueError (it was stored modulo 65536).
    """
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"write_shards: shard_tokens must be a positive int, got {shard_tokens!r}")
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"write_shards: max_tokens must be an int >= 0 (0 = no limit), got {max_tokens!r}")
    out_dir = Path(out_dir)
    old = sorted(out_dir.glob(f"{prefix}_*.bin"))
    if old:
        raise ValueError(f"{out_dir} holds {len(old)} {prefix} shards already ({old[0].name}, ...): choose another "
                         "folder, or remove them first")
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = np.empty(shard_tokens, dtype=np.uint16)
    fill, total, paths = 0, 0, []

    def flush() -> None:
        nonlocal fill
        path = out_dir / shard_name(prefix, len(paths))
        write_shard(path, buf[:fill])
        paths.append(path)
        fill = 0

    progress = _progress_bar(max_tokens or None)
    for arr in token_arrays:
        arr = np.asarray(arr)
        if max_tokens:
            arr = arr[: max_tokens - total]
        if len(arr) and not (arr.min() >= 0 and arr.max() <= np.iinfo(np.uint16).max):
            bad = arr[(arr < 0) | (arr > np.iinfo(np.uint16).max)][0]
            raise ValueError(f"token id {bad} does not fit a .bin shard (uint16: ids 0-65535)")
        pos = 0
        while pos < len(arr):
            take = min(shard_tokens - fill, len(arr) - pos)
            buf[fill:fill + take] = arr[pos:pos + take]
            fill, pos = fill + take, pos + take
            if fill == shard_tokens:
                flush()
        total += len(arr)
        if progress is not None:
            progress.update(len(arr))
        if max_tokens and total >= max_tokens:
            break
    if fill:
        flush()
    if progress is not None:
        progress.close()
    return paths


def _progress_bar(total: int | None):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return None
    return tqdm(total=total, unit="tok", unit_scale=True, delay=2.0, desc="fineweb")


_ENCODER = None


def _gpt2_encode(text: str) -> list[int]:
    """Module-level (picklable) GPT-2 encoder for worker processes; ignores special-token strings in the text."""
    global _ENCODER
    if _ENCODER is None:
        import tiktoken

        _ENCODER = tiktoken.get_encoding("gpt2")
    return _ENCODER.encode_ordinary(text)


def _require_deps():
    try:
        import datasets
        import tiktoken
    except ImportError as e:
        raise ModuleNotFoundError(f"midlayer.data.fineweb needs the 'datasets' and 'tiktoken' packages ({e}); "
                                  f"install them with: {_INSTALL_HINT}") from e
    return datasets, tiktoken


def main(argv: list[str] | None = None) -> list[Path]:
    """Command line: stream FineWeb, tokenize with GPT-2 BPE, write shards. Returns the shard paths."""
    ap = argparse.ArgumentParser(prog="python -m midlayer.data.fineweb", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="data/fineweb10B", help="folder for the .bin shards")
    ap.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    ap.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens in total (0 = all)")
    ap.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="tokenizer worker processes")
    ap.add_argument("--config", default=CONFIG, help=f"{DATASET} config (sample-10BT, sample-100BT, ...)")
    args = ap.parse_args(argv)
    if args.shard_tokens < 1:
        ap.error(f"--shard-tokens must be positive, got {args.shard_tokens}")
    if args.max_tokens < 0:
        ap.error(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.num_proc < 1:
        ap.error(f"--num-proc must be >= 1, got {args.num_proc}")
    datasets, tiktoken = _require_deps()
    if tiktoken.get_encoding("gpt2").eot_token != GPT2_EOT:  # also fetches the BPE file once, before forking
        raise RuntimeError("tiktoken's gpt2 encoding has an unexpected end-of-text id")

    ds = datasets.load_dataset(DATASET, name=args.config, split="train", streaming=True)
    texts = (row["text"] for row in ds)
    if args.num_proc == 1:
        arrays: Iterable[np.ndarray] = tokenize_documents(texts, _gpt2_encode, GPT2_EOT)
        paths = write_shards(arrays, args.out_dir, args.shard_tokens, "fineweb", args.max_tokens)
    else:
        import multiprocessing as mp

        with mp.Pool(args.num_proc) as pool:
            arrays = _with_eot(_parallel_encode(pool, texts, args.num_proc), GPT2_EOT)
            paths = write_shards(arrays, args.out_dir, args.shard_tokens, "fineweb", args.max_tokens)
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()


__all__ = ["tokenize_documents", "write_shards", "shard_name", "main", "GPT2_EOT"]

"""Byte-level BPE tokenizer for the embedded corpus, trained with the `tokenizers` library and cached.

Why byte-level BPE: like GPT-2's tokenizer it can encode any string (no unknown tokens), and a small
vocabulary (default 4096) trained on the corpus itself gives a small embedding table for CPU-sized models.
`<|endoftext|>` (id 0, the only special token) separates documents in the token stream.

Training on the 4.6 MB training split takes about 1 s on 2 CPU cores and is deterministic (same texts and
vocab size give byte-identical `tokenizer.json`; checked in tests/test_data.py).

Cache: `<cache_dir>/tokenizer.json` plus `<cache_dir>/tokenizer_meta.json` with the data fingerprint, the
requested vocab size and the sha256 of `tokenizer.json`. The cache is used only if all three match and the
file loads; otherwise (other data, other vocab size, a corrupt, truncated or hand-edited file) the tokenizer
is retrained and the cache rewritten, with a warning for the corrupt case. Retraining rather than failing is
safe because the cache holds nothing that cannot be recomputed in a second.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from midlayer.common import atomic_write

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"
_META_VERSION = 1
MIN_VOCAB = 257 + 1  # 256 byte symbols + EOT + at least one merge
MAX_VOCAB = 65536  # token ids must fit the uint16 shard format


def _check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(
            f"tokenizer vocab_size must be an int in [{MIN_VOCAB}, {MAX_VOCAB}] (256 bytes + {EOT} + merges; "
            f"ids must fit uint16 shards), got {vocab_size!r}"
        )


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries (including the 256 bytes and EOT) on `texts`.

    The result can be smaller than `vocab_size` if the texts run out of pairs to merge (tiny inputs).
    """
    _check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: encoding must be plain concatenation-friendly, so decode(encode(s)) == s.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.token_to_id(EOT) is None:  # pragma: no cover - guaranteed by the trainer
        raise RuntimeError(f"tokenizer training lost the {EOT} special token")
    return tok


def eot_id(tok: Tokenizer) -> int:
    """Id of the document separator; raises ValueError if the tokenizer has none (not one of ours)."""
    i = tok.token_to_id(EOT)
    if i is None:
        raise ValueError(f"tokenizer has no {EOT} token; it was not built by midlayer.data.tokenizer")
    return i


def _load_cached(cache_dir: Path, vocab_size: int, fingerprint: str) -> Tokenizer | None:
    """The cached tokenizer if it is valid for (vocab_size, fingerprint), else None (warning if corrupt)."""
    tok_path, meta_path = cache_dir / TOKENIZER_FILE, cache_dir / META_FILE
    if not tok_path.exists() or not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        warnings.warn(f"{meta_path}: unreadable tokenizer cache metadata ({e}); retraining the tokenizer")
        return None
    if (meta.get("version"), meta.get("fingerprint"), meta.get("vocab_size")) != (_META_VERSION, fingerprint, vocab_size):
        return None  # a different corpus or vocab size: an ordinary cache miss
    raw = tok_path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != meta.get("sha256"):
        warnings.warn(f"{tok_path}: contents do not match the checksum in {meta_path.name} (corrupt or edited); "
                      "retraining the tokenizer")
        return None
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
        eot_id(tok)
    except Exception as e:  # tokenizers raises its own Exception subclass for bad JSON
        warnings.warn(f"{tok_path}: cannot load cached tokenizer ({e}); retraining the tokenizer")
        return None
    return tok


def load_or_train_tokenizer(cache_dir: Path, vocab_size: int, texts: Iterable[str], fingerprint: str) -> Tokenizer:
    """Load the tokenizer cached in `cache_dir` for (fingerprint, vocab_size), or train it on `texts` and cache it.

    `fingerprint` identifies the training texts (see `midlayer.data.corpus.corpus_fingerprint`); `texts` is only
    consumed on a cache miss, so callers can pass a generator. A corrupt cache is retrained, with a warning.
    """
    _check_vocab_size(vocab_size)
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"load_or_train_tokenizer: fingerprint must be a non-empty string, got {fingerprint!r}")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok = _load_cached(cache_dir, vocab_size, fingerprint)
    if tok is not None:
        return tok
    tok = train_tokenizer(texts, vocab_size)
    raw = tok.to_str().encode("utf-8")
    atomic_write(cache_dir / TOKENIZER_FILE, raw)
    meta = {"version": _META_VERSION, "fingerprint": fingerprint, "vocab_size": vocab_size,
            "actual_vocab_size": tok.get_vocab_size(), "sha256": hashlib.sha256(raw).hexdigest()}
    # Metadata last: a crash between the two writes leaves a checksum mismatch, i.e. a retrain, never a
    # tokenizer.json that is trusted for the wrong data.
    atomic_write(cache_dir / META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return tok


__all__ = ["EOT", "train_tokenizer", "load_or_train_tokenizer", "eot_id", "TOKENIZER_FILE", "META_FILE"]

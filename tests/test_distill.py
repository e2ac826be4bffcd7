"""Prompt set and self-distillation data (midlayer.data.prompts, midlayer.speculative.distill) on a tiny random model."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import torch

from midlayer.config import ModelConfig
from midlayer.speculative.distill import (DistillFormatError, DistillMismatchError, DistillSet, batches, distill)
from midlayer.engine.generate import GenerationConfig, generate
from midlayer.model.transformer import Transformer
from midlayer.data.prompts import (CATEGORIES, INSTRUCTION_CATEGORIES, Prompt, assign_splits, instruction_prompts,
                              math_questions, prompt_set)

MAX_NEW = 10


def make_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=128, multiple_of=32,
                      gating=False, norm_placement="pre")
    return Transformer(cfg).eval()


class CharTok:
    """Stand-in for TextTokenizer: a fake chat template around one id per character."""

    def __init__(self, eos_ids: set[int]):
        self.eos_ids = set(eos_ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids = [1]
        for m in messages:
            ids += [2] + [4 + ord(c) % 60 for c in m["content"][:60]] + [3]
        return ids


PROMPTS = [Prompt(f"p{i}", "qa" if i % 2 else "code", text, "heldout" if i % 3 == 0 else "train")
           for i, text in enumerate(["hi", "what is two plus two?", "a much longer request about many things",
                                     "short", "write a poem about the sea", "x", "translate: bonjour le monde"])]


@pytest.fixture(scope="module")
def model() -> Transformer:
    return make_model(0)


@pytest.fixture(scope="module")
def tok(model: Transformer) -> CharTok:
    # make the third greedy token of one prompt a stop token, so some responses really stop early
    probe = CharTok(set()).encode_chat([{"role": "user", "content": PROMPTS[1].text}])
    first = generate(model, [probe], GenerationConfig(max_new_tokens=3))[0]
    return CharTok({first[2]})


def run(model, tok, path, prompts=PROMPTS, **kw) -> DistillSet:
    kw = {"max_new_tokens": MAX_NEW, "batch_size": 3, "progress": False, **kw}
    return distill(model, tok, prompts, path, **kw)


# --------------------------------------------------------------------------------------------- prompts
def test_prompt_set_deterministic_unique_and_split_per_category():
    ps = prompt_set()
    assert ps == prompt_set()
    assert len({p.id for p in ps}) == len(ps)
    counts = Counter((p.category, p.split) for p in ps)
    for cat in CATEGORIES:
        n = counts[(cat, "train")] + counts[(cat, "heldout")]
        assert n >= 20, cat
        assert counts[(cat, "train")] > 0 and counts[(cat, "heldout")] > 0, cat
        assert 0.15 <= counts[(cat, "heldout")] / n <= 0.25, cat
    assert {p.split for p in ps} == {"train", "heldout"}
    # the math questions come from the committed file: the generator package is not needed (nor imported)
    assert "mathematics_dataset" not in sys.modules
    assert len(math_questions()) == 60
    # the seed only moves the Shakespeare passages
    other = prompt_set(seed=1)
    fixed = {p for p in ps if not p.category.startswith("passage")}
    assert fixed == {p for p in other if not p.category.startswith("passage")}
    assert {p.id for p in ps} != {p.id for p in other}


def test_instructions_and_passages_are_well_formed():
    instr = instruction_prompts()
    assert len(instr) >= 160
    per = Counter(c for _, c, _ in instr)
    assert all(per[c] >= 20 for c in INSTRUCTION_CATEGORIES)
    # summarisation and extraction requests carry the text they work on
    assert all('"' in t for _, c, t in instr if c in ("summarisation", "extraction"))
    for p in prompt_set():
        if p.category.startswith("passage"):
            head, body = p.text.split("\n\n", 1)
            assert head in ("Continue this passage:", "Summarise this passage in two sentences:")
            assert 60 <= len(body.split()) <= 120


def test_split_depends_on_ids_only():
    items = [(f"id{i}", "a" if i % 2 else "b", "t") for i in range(40)]
    a = {p.id: p.split for p in assign_splits(items)}
    b = {p.id: p.split for p in assign_splits(items[::-1])}
    assert a == b and Counter(a.values()) == {"train": 32, "heldout": 8}


# --------------------------------------------------------------------------------------------- distill
def test_distill_equals_unbatched_generate(model, tok, tmp_path):
    ds = run(model, tok, tmp_path / "d.jsonl")
    assert {r.id for r in ds.records} == {p.id for p in PROMPTS}
    by_id = {p.id: p for p in PROMPTS}
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, stop_tokens=tuple(sorted(tok.eos_ids)))
    stopped = 0
    for r in ds.records:
        p = by_id[r.id]
        assert (r.category, r.split) == (p.category, p.split)
        assert r.prompt_ids == tok.encode_chat([{"role": "user", "content": p.text}])
        assert r.response_ids == generate(model, [r.prompt_ids], cfg)[0]
        stopped += r.response_ids[-1] in tok.eos_ids
    assert stopped >= 1  # the stop token is kept and ends the row
    # DistillSet views
    assert ds.sequences("train") == [r.prompt_ids + r.response_ids for r in ds.split("train")]
    assert ds.prompt_lens("heldout") == [len(r.prompt_ids) for r in ds.split("heldout")]
    assert len(ds.split("train")) + len(ds.split("heldout")) == len(PROMPTS)
    assert ds.pad_id == min(tok.eos_ids)
    with pytest.raises(ValueError):
        ds.split("validation")


def test_resume_gives_identical_file(model, tok, tmp_path):
    path = tmp_path / "d.jsonl"
    run(model, tok, path)
    full = path.read_bytes()
    lines = full.split(b"\n")  # header, 7 records, ""
    # interrupted after 4 records: the rest is generated (in other batches) and appended identically
    path.write_bytes(b"\n".join(lines[:5]) + b"\n")
    run(model, tok, path, prompts=PROMPTS[::-1])  # the order prompts are given in does not matter
    assert path.read_bytes() == full
    # interrupted in the middle of writing a line
    path.write_bytes(full[:-7])
    with pytest.warns(UserWarning, match="truncated"):
        assert len(DistillSet.load(path)) == len(PROMPTS) - 1
    with pytest.warns(UserWarning, match="truncated"):
        run(model, tok, path)
    assert path.read_bytes() == full
    # a complete file is left alone
    run(model, tok, path)
    assert path.read_bytes() == full


def test_refuses_other_model_settings_and_corrupt_files(model, tok, tmp_path):
    path = tmp_path / "d.jsonl"
    run(model, tok, path, prompts=PROMPTS[:3])
    before = path.read_bytes()
    with pytest.raises(DistillMismatchError, match="different base model"):
        run(make_model(1), tok, path)
    with pytest.raises(DistillMismatchError, match="max_new_tokens"):
        run(model, tok, path, max_new_tokens=MAX_NEW + 1)
    with pytest.raises(DistillMismatchError, match="weights"):
        run(model, tok, path, weights_note="bf16")
    with pytest.raises(DistillMismatchError, match="stop_tokens"):
        run(model, CharTok({0}), path)
    assert path.read_bytes() == before  # refusals write nothing
    # a corrupt header, and a corrupt record that is not the last one, are errors (not guessed around)
    lines = before.split(b"\n")
    path.write_bytes(b'{"format": "midlayer-dis' + b"\n" + b"\n".join(lines[1:]))
    with pytest.raises(DistillFormatError, match="header"):
        run(model, tok, path)
    path.write_bytes(b"\n".join([lines[0], lines[1][:10], *lines[2:]]))
    with pytest.raises(DistillFormatError, match="middle"):
        DistillSet.load(path)
    header = json.loads(lines[0])
    assert header["max_new_tokens"] == MAX_NEW and header["weights"] == "fp32"


# --------------------------------------------------------------------------------------------- batches
def test_batches_masks_grouping_and_determinism():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (int(n),), generator=g).tolist() for n in torch.randint(0, 40, (60,), generator=g)]
    out = batches(seqs, batch_tokens=96, seq_len=24, seed=3, pad_id=63)
    again = batches(seqs, batch_tokens=96, seq_len=24, seed=3, pad_id=63)
    assert len(out) == len(again) and all(torch.equal(a, c) and torch.equal(b, d)
                                          for (a, b), (c, d) in zip(out, again))
    other = batches(seqs, batch_tokens=96, seq_len=24, seed=4, pad_id=63)
    assert [t.tolist() for t, _ in other] != [t.tolist() for t, _ in out]
    rows = []
    for tokens, mask in out:
        assert tokens.dtype == torch.long and mask.dtype == torch.bool and tokens.shape == mask.shape
        B, T = tokens.shape
        assert T <= 24 and (B * T <= 96 or B == 1)
        assert mask[:, 0].all() and mask.any(0)[-1]  # right padding only, no all-padding column
        assert (tokens[~mask] == 63).all()
        # real tokens form a prefix of each row
        assert torch.equal(mask, torch.arange(T)[None] < mask.sum(1, keepdim=True))
        rows += [tokens[b, :int(mask[b].sum())].tolist() for b in range(B)]
    expect = [s[:24] for s in seqs if len(s) >= 2]
    assert sorted(rows) == sorted(expect)
    with pytest.raises(ValueError):
        batches(seqs, batch_tokens=0, seq_len=24, seed=0)


def test_sampled_distill_is_seeded_and_resumes_identically(model, tok, tmp_path):
    path = tmp_path / "s.jsonl"
    full = run(model, tok, path, temperature=1.0, sample_seed=3)
    data = path.read_bytes()
    greedy = run(model, tok, tmp_path / "g.jsonl")
    assert [r.response_ids for r in full.records] != [r.response_ids for r in greedy.records]
    # cut in the middle of the second batch (and of a line): the batch is generated again whole, and only
    # its missing records are appended, so the file is byte-identical to the uninterrupted one
    lines = data.split(b"\n")
    path.write_bytes(b"\n".join(lines[:5]) + b"\n" + lines[5][:9])
    with pytest.warns(UserWarning, match="truncated"):
        run(model, tok, path, temperature=1.0, sample_seed=3)
    assert path.read_bytes() == data
    with pytest.raises(DistillMismatchError, match="sample_seed"):
        run(model, tok, path, temperature=1.0, sample_seed=4)
    with pytest.raises(DistillMismatchError, match="temperature"):
        run(model, tok, path)
    with pytest.raises(DistillMismatchError, match="batch_size"):  # other batches, other seeds
        run(model, tok, path, temperature=1.0, sample_seed=3, batch_size=2)

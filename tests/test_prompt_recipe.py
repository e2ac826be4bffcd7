"""The scaled prompt set (midlayer.data.prompt_recipe): determinism, dedup, splits, the committed file."""

from __future__ import annotations

import gzip
from collections import Counter

import pytest

from midlayer.data import prompt_recipe as pr


@pytest.fixture(scope="module")
def small():
    return pr.build(seed=0, per_category=40)


def test_recipe_is_deterministic_and_seeded(small):
    assert pr.build(seed=0, per_category=40) == small
    other = pr.build(seed=1, per_category=40)
    assert {p.text for p in other} != {p.text for p in small}


def test_every_category_split_and_no_exact_duplicates(small):
    cats = Counter(p.category for p in small)
    assert set(cats) == set(pr.CATEGORIES)
    keys = [pr.normalise(p.text) for p in small]
    assert len(keys) == len(set(keys))
    ids = [p.id for p in small]
    assert len(ids) == len(set(ids))
    for c in pr.CATEGORIES:  # both splits in every category, and disjoint by construction of the ids
        splits = Counter(p.split for p in small if p.category == c)
        assert splits["train"] > 0 and splits["heldout"] > 0, c


def test_near_duplicates_found_and_distinct_texts_kept():
    passage = ("The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden "
               "gate and the sun sets slowly behind the distant hills of the quiet valley")
    texts = [f"Summarise this passage: {passage}",
             "Write a haiku about the ocean at night.",
             f"Summarise this passage: {passage} today",            # one word added: near-duplicate of 0
             "Explain photosynthesis to children.",
             "Write a limerick about a lost key for teenagers."]
    assert pr.near_duplicates(texts) == {2}
    # MinHash estimates Jaccard: identical shingle sets give 1, disjoint ones about 0
    sig = pr.minhash([texts[0], texts[0], texts[3]])
    assert (sig[0] == sig[1]).all() and (sig[0] == sig[2]).mean() < 0.1


def test_committed_file_is_the_recipes_output_at_scale(tmp_path):
    prompts = pr.load()
    assert len(prompts) >= 20000
    cats = Counter(p.category for p in prompts)
    assert set(cats) == set(pr.CATEGORIES) and min(cats.values()) >= 1000
    held = [p for p in prompts if p.split == "heldout"]
    assert 0.03 < len(held) / len(prompts) < 0.07
    assert not {p.text for p in held} & {p.text for p in prompts if p.split == "train"}
    # the committed file was written by this version of the recipe (a full rebuild and comparison, ~10 s:
    # python -m midlayer.data.prompt_recipe --check)
    import json
    with gzip.open(pr.SCALED_FILE, "rt") as f:
        header = json.loads(f.readline())
    assert header["recipe"] == pr.recipe_hash(), "prompt_recipe.py changed: rewrite the file with --write"
    # and its content is the recipe's: one category rebuilt alone gives the committed texts and splits
    # (math: numbers drawn by the recipe, nothing from the corpus or the Python version)
    rebuilt = pr.build(seed=header["seed"], categories=("math",))
    assert [(p.id, p.text, p.split) for p in rebuilt] == \
        [(p.id, p.text, p.split) for p in prompts if p.category == "math"]


def test_damaged_files_are_refused(tmp_path):
    good = pr.build(seed=0, per_category=5)
    path = pr.save(good, tmp_path / "p.jsonl.gz", seed=0)
    assert pr.load(path) == good
    raw = gzip.decompress(path.read_bytes())
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(raw[: len(raw) // 2].rsplit(b"\n", 1)[0] + b"\n"))
    with pytest.raises(ValueError, match="truncated"):
        pr.load(tmp_path / "cut.jsonl.gz")
    (tmp_path / "bad.jsonl.gz").write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="damaged"):
        pr.load(tmp_path / "bad.jsonl.gz")
    (tmp_path / "other.jsonl.gz").write_bytes(gzip.compress(b'{"format": "x"}\n'))
    with pytest.raises(ValueError, match="not a midlayer-prompts-v1"):
        pr.load(tmp_path / "other.jsonl.gz")

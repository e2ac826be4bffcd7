"""The prompt set for self-distillation of draft models, built only from what is available offline.

Three sources, each its own category (so acceptance rates and held-out scores can be reported per kind of
request):

* Instructions the team wrote (`prompt_data/instructions.jsonl`, fields {"category", "text"}): 24 natural
  user requests in each of `writing`, `qa`, `math`, `code`, `summarisation`, `translation`, `extraction`
  (168 in all). Summarisation and extraction requests carry the short text they work on inline, so every
  prompt is self-contained.
* `dm_math`: 60 questions from DeepMind's generator, the `mathematics-dataset` PyPI package (5 from each
  of 12 modules, "train-easy" difficulty). They are generated once and committed as package data
  (`prompt_data/math.jsonl`, with the reference answers), so neither users nor CI need the package;
  `regenerate_math_file()` rebuilds the file and the file is only generated on demand when it is absent.
  Two compatibility notes on mathematics-dataset 1.0.1 with today's libraries: it imports
  `sympy.solvers.diophantine.base_solution_linear`, which sympy >= 1.7 moved into a submodule (we alias it
  back before importing); and its `polynomials`/`calculus` modules call `ndarray.itemset`, removed in
  numpy 2, so we use none of those modules. Its output also depends on Python's string-hash seed (variable
  names are drawn from sets), so regeneration runs in a subprocess with PYTHONHASHSEED=0.
* Passages of the embedded Shakespeare corpus (`midlayer.data.corpus`): `passage_continue` ("Continue this
  passage: ...") and `passage_summary` ("Summarise this passage in two sentences: ..."), 20 each, 60-120
  words, cut at line boundaries starting at the beginning of a speech/stanza. Each passage comes from a
  different work; which work and where is drawn from a generator seeded by `prompt_set(seed=...)`.

Ids are stable: instructions and math questions are named by a hash of their text (so reordering or adding
entries never renames others), passages by (kind, work, line number). The held-out split is a function of
the ids alone: within each category, the ~20% of ids with the smallest sha256 go to "heldout", the rest to
"train". Ranking inside each category (rather than thresholding each hash) guarantees that every category
has prompts in both splits while keeping the assignment stable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from midlayer.common import atomic_write
from .corpus import corpus_documents

PROMPT_DATA = Path(__file__).resolve().parent / "prompt_data"
INSTRUCTIONS_FILE = PROMPT_DATA / "instructions.jsonl"
MATH_FILE = PROMPT_DATA / "math.jsonl"

INSTRUCTION_CATEGORIES = ("writing", "qa", "math", "code", "summarisation", "translation", "extraction")
CATEGORIES = INSTRUCTION_CATEGORIES + ("dm_math", "passage_continue", "passage_summary")
SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.2

# mathematics-dataset modules used (module path inside `modules.train(...)`). All avoid numpy-2-broken code.
MATH_MODULES = (
    "arithmetic__add_or_sub", "arithmetic__mul", "arithmetic__div", "arithmetic__mixed",
    "algebra__linear_1d", "algebra__linear_2d", "algebra__sequence_next_term",
    "numbers__gcd", "numbers__lcm", "numbers__div_remainder",
    "comparison__sort", "measurement__time",
)
MATH_PER_MODULE = 5
MATH_SEED = 2404  # fixed: the committed math.jsonl is the output for this seed
MATH_INSTALL_HINT = "pip install mathematics-dataset  (or: pip install 'midlayer[draft]')"

PASSAGES_PER_KIND = 20
PASSAGE_MIN_WORDS = 60
PASSAGE_MAX_WORDS = 120
_PASSAGE_TEMPLATES = {
    "passage_continue": "Continue this passage:\n\n{}",
    "passage_summary": "Summarise this passage in two sentences:\n\n{}",
}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    split: str  # "train" or "heldout"


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; a ValueError naming the file and line for anything else (a missing
    file, bytes that are not UTF-8, a line that is not JSON or not an object)."""
    out, n = [], 0
    try:
        with open(path, "rb") as f:  # (bytes, decoded a line at a time: text mode decodes ahead, so no line number)
            for n, raw in enumerate(f, 1):
                line = raw.decode("utf-8")
                if line.strip():
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
                    out.append(rec)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{n}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    return out


# ----------------------------------------------------------------------------------------- instructions
def instruction_prompts(path: str | Path = INSTRUCTIONS_FILE) -> list[tuple[str, str, str]]:
    """The team-written instructions as (id, category, text), in file order; id = category-sha256(text)[:10]."""
    out = []
    for n, rec in enumerate(_read_jsonl(Path(path)), 1):
        cat, text = rec.get("category"), rec.get("text")
        if cat not in INSTRUCTION_CATEGORIES or not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: entry {n} needs a category in {INSTRUCTION_CATEGORIES} and a text, "
                             f"got {rec!r}")
        out.append((f"{cat}-{_sha(text)[:10]}", cat, text))
    return out


# --------------------------------------------------------------------------------------------- math
def _import_math_modules() -> Any:
    """Import mathematics_dataset's module registry, aliasing the sympy function it expects at its old place."""
    import importlib

    try:
        dio = importlib.import_module("sympy.solvers.diophantine")
        if not hasattr(dio, "base_solution_linear"):
            from sympy.solvers.diophantine.diophantine import base_solution_linear
            dio.base_solution_linear = base_solution_linear
        from mathematics_dataset import generate_settings
        from mathematics_dataset.modules import modules
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"generating math questions needs mathematics-dataset ({e}); install it with: "
                                  f"{MATH_INSTALL_HINT}") from e
    return modules, generate_settings


def generate_math_questions(per_module: int = MATH_PER_MODULE, seed: int = MATH_SEED,
                            module_names: tuple[str, ...] = MATH_MODULES) -> list[dict[str, str]]:
    """Questions from mathematics-dataset, in-process: [{"id", "module", "text", "answer"}].

    Deterministic for a given seed *only* under a fixed string-hash seed (PYTHONHASHSEED); use
    `regenerate_math_file`, which takes care of that. Each module gets its own seed (from the module name),
    so the questions of one module do not depend on which other modules are used.
    """
    import numpy as np

    if sys.flags.hash_randomization and os.environ.get("PYTHONHASHSEED") in (None, "", "random"):
        warnings.warn("generate_math_questions: string hashing is randomised in this process, so the output "
                      "is not reproducible; regenerate_math_file() runs it with PYTHONHASHSEED=0", stacklevel=2)
    modules, settings = _import_math_modules()

    def easy(range_: tuple[float, float]) -> tuple[float, float]:
        # the lowest third of each module's entropy range, as the package's "train-easy" level: short
        # questions whose answers a small model can state
        lo, hi = range_
        return lo, lo + (hi - lo) / 3

    registry = modules.train(easy)
    out = []
    for name in module_names:
        group, sub = name.split("__", 1)
        fn = registry[group][sub]
        s = zlib.crc32(f"{seed}:{name}".encode())
        random.seed(s)
        np.random.seed(s)
        got, seen = 0, set()
        while got < per_module:
            problem = fn()
            q, a = str(problem.question).strip(), str(problem.answer).strip()
            # the package's own length limits, and no repeats
            if len(q) > settings.MAX_QUESTION_LENGTH or len(a) > settings.MAX_ANSWER_LENGTH or q in seen:
                continue
            seen.add(q)
            out.append({"id": f"dm_math-{_sha(q)[:10]}", "module": name, "text": q, "answer": a})
            got += 1
    return out


def regenerate_math_file(path: str | Path = MATH_FILE) -> Path:
    """(Re)write the cached math questions with mathematics-dataset, reproducibly (subprocess with a fixed
    hash seed). Needs the package; the file is committed, so this is only for changing the selection."""
    _import_math_modules()  # a clear error here rather than a traceback from the subprocess
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run([sys.executable, "-m", "midlayer.data.prompts", "--write-math", str(path)], env=env, check=True)
    return Path(path)


def _write_math(path: Path) -> None:
    qs = generate_math_questions()
    atomic_write(path, "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in qs).encode("utf-8"))


def math_questions(path: str | Path = MATH_FILE) -> list[dict[str, str]]:
    """The cached math questions; generated (and cached) on first use if the file is absent."""
    p = Path(path)
    if not p.is_file():
        regenerate_math_file(p)
    recs = _read_jsonl(p)
    for r in recs:
        if not {"id", "module", "text", "answer"} <= set(r):
            raise ValueError(f"{p}: record without id/module/text/answer: {r!r}")
    return recs


# ------------------------------------------------------------------------------------------ passages
def _passage_at(lines: list[str], start: int, target_words: int) -> tuple[str, int] | None:
    """Lines from `start` until at least `target_words` words; (text, words) or None if the document ends."""
    words, end = 0, start
    while end < len(lines) and words < target_words:
        words += len(lines[end].split())
        end += 1
    if words < target_words:
        return None
    return "\n".join(lines[start:end]).strip(), words


def passage_prompts(seed: int = 0, per_kind: int = PASSAGES_PER_KIND, min_words: int = PASSAGE_MIN_WORDS,
                    max_words: int = PASSAGE_MAX_WORDS) -> list[tuple[str, str, str]]:
    """Shakespeare passages as (id, category, text): `per_kind` continuation and `per_kind` summary prompts.

    Each passage starts at the beginning of a speech or stanza (a line after a blank line), skips the first
    and last 5% of its work (title pages, cast lists, epilogues), and has a word count drawn uniformly
    from [min_words, max_words] (whole lines, so it may overshoot by part of a line; longer ones are
    redrawn). Works are used once each, in a seeded order, while there are enough of them.
    """

    docs = corpus_documents()
    rng = random.Random(f"midlayer-passages-{seed}")
    order = list(range(len(docs)))
    rng.shuffle(order)
    kinds = list(_PASSAGE_TEMPLATES)
    out: list[tuple[str, str, str]] = []
    used: set[tuple[str, int]] = set()
    need = per_kind * len(kinds)
    attempts = 0
    while len(out) < need:
        attempts += 1
        if attempts > 100 * need:
            raise RuntimeError(f"passage_prompts: could not find {need} passages of {min_words}-{max_words} words")
        name, text = docs[order[len(out) % len(order)] if len(out) < len(order) else rng.randrange(len(docs))]
        lines = text.split("\n")
        lo, hi = int(0.05 * len(lines)), int(0.95 * len(lines))
        starts = [i for i in range(max(lo, 1), hi) if lines[i].strip() and not lines[i - 1].strip()]
        if not starts:
            continue
        start = rng.choice(starts)
        got = _passage_at(lines, start, rng.randint(min_words, max_words))
        if got is None or got[1] > max_words or (name, start) in used:
            continue
        used.add((name, start))
        kind = kinds[len(out) % len(kinds)]
        out.append((f"{kind}-{name}-L{start}", kind, _PASSAGE_TEMPLATES[kind].format(got[0])))
    return out


# --------------------------------------------------------------------------------------------- the set
def assign_splits(items: list[tuple[str, str, str]], heldout_fraction: float = HELDOUT_FRACTION) -> list[Prompt]:
    """(id, category, text) -> Prompts: in each category, the round(f * n) ids with the smallest sha256 (at
    least 1 and at most n - 1 when n >= 2) are "heldout". Depends on the ids only, not on their order."""
    by_cat: dict[str, list[str]] = {}
    for pid, cat, _ in items:
        by_cat.setdefault(cat, []).append(pid)
    held: set[str] = set()
    for ids in by_cat.values():
        n = len(ids)
        k = min(max(round(heldout_fraction * n), 1), n - 1) if n >= 2 else 0
        held.update(sorted(ids, key=_sha)[:k])
    return [Prompt(pid, cat, text, "heldout" if pid in held else "train") for pid, cat, text in items]


def prompt_set(seed: int = 0) -> list[Prompt]:
    """The full prompt set (instructions, dm_math, Shakespeare passages), deterministic for a seed.

    `seed` only changes which Shakespeare passages are used; instructions and math questions are fixed.
    """
    items = instruction_prompts()
    items += [(q["id"], "dm_math", q["text"]) for q in math_questions()]
    items += passage_prompts(seed)
    dup = [pid for pid, c in Counter(pid for pid, _, _ in items).items() if c > 1]
    if dup:
        raise ValueError(f"prompt_set: duplicate prompt ids {dup[:5]} (duplicate texts in the data files?)")
    return assign_splits(items)


def summary(prompts: list[Prompt], categories: tuple[str, ...] = CATEGORIES, name_width: int = 18,
            count_width: int = 4) -> str:
    """Counts per category (in the order of `categories`) and split, one line per category, then the total."""
    c = Counter((p.category, p.split) for p in prompts)
    cats = [k for k in categories if any(p.category == k for p in prompts)]
    rows = [f"{k:<{name_width}} train {c[(k, 'train')]:>{count_width}}  heldout {c[(k, 'heldout')]:>4}"
            for k in cats]
    rows.append(f"{'total':<{name_width}} train {sum(v for (_, s), v in c.items() if s == 'train'):>{count_width}}  "
                f"heldout {sum(v for (_, s), v in c.items() if s == 'heldout'):>4}")
    return "\n".join(rows)


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Print the prompt set's counts, or regenerate the math questions.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--regenerate-math", action="store_true", help=f"rewrite {MATH_FILE.name} (needs the package)")
    ap.add_argument("--write-math", metavar="PATH", help=argparse.SUPPRESS)  # the subprocess side of regeneration
    args = ap.parse_args(argv)
    if args.write_math:
        _write_math(Path(args.write_math))
        return
    if args.regenerate_math:
        print(f"wrote {regenerate_math_file()}")
    print(summary(prompt_set(args.seed)))


if __name__ == "__main__":
    _main()


__all__ = ["Prompt", "prompt_set", "assign_splits", "instruction_prompts", "math_questions",
           "generate_math_questions", "regenerate_math_file", "passage_prompts", "summary", "CATEGORIES",
           "INSTRUCTION_CATEGORIES", "SPLITS", "HELDOUT_FRACTION", "MATH_FILE", "INSTRUCTIONS_FILE"]

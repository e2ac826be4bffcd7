"""Lossless speculative decoding: the draft tree and its verification loop, the drafters (Medusa, early exit,
layer skip and learned skip gates, EAGLE / EAGLE-2, hidden transfer of arXiv 2404.12022), the draft file
registry, the tree-cost model that prices a round, self-distillation data and draft training.

May import every layer below it. The `Drafter` protocol in `protocol.py` is what the loop and the cost model
see of a drafter.
"""

import importlib
from pathlib import Path


def __getattr__(name: str) -> object:
    """`from midlayer.speculative import X` for the names of the old module `midlayer.speculative`, now `midlayer.speculative.verify`.

    Looked up lazily, so that importing one submodule does not load `verify`. A submodule's own name and
    dunders are left to the import system.
    """
    if name.startswith("__") or (Path(__file__).parent / f"{name}.py").exists():
        raise AttributeError(f"module 'midlayer.speculative' has no attribute {name!r}")
    try:  # imported on first use: no start-up cost for the other submodules
        return getattr(importlib.import_module("midlayer.speculative.verify"), name)
    except AttributeError:
        raise AttributeError(f"module 'midlayer.speculative' has no attribute {name!r}") from None

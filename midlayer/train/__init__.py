"""Training: the one training loop (its named steps), evaluation, checkpoints that pickle no class paths, and
the torchrun process group (DDP / FSDP2, one code path for 1 and N processes).

May import everything below it: `common`, `ops`, `config`, `data`, `model`.
"""

import importlib
from pathlib import Path


def __getattr__(name: str) -> object:
    """`from midlayer.train import X` for the names of the old module `midlayer.train`, now `midlayer.train.loop`.

    Looked up lazily, so that importing one submodule does not load `loop`. A submodule's own name and
    dunders are left to the import system.
    """
    if name.startswith("__") or (Path(__file__).parent / f"{name}.py").exists():
        raise AttributeError(f"module 'midlayer.train' has no attribute {name!r}")
    try:  # imported on first use: no start-up cost for the other submodules
        return getattr(importlib.import_module("midlayer.train.loop"), name)
    except AttributeError:
        raise AttributeError(f"module 'midlayer.train' has no attribute {name!r}") from None

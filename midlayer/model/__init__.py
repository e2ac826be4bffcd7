"""The Transformer: layers, attention and its one mask rule, the skip-middle gates and routers (arXiv
2506.21103), their sparsity controllers, the SSM mixer, the KV-cache views the blocks read and write, and the
FLOPs model as pure functions beside it.

May import `common`, `ops`, `config` and `data`. Nothing here trains, decodes or drafts.
"""

import importlib
from pathlib import Path


def __getattr__(name: str) -> object:
    """`from midlayer.model import X` for the names of the old module `midlayer.model`, now `midlayer.model.transformer`.

    Looked up lazily, so that importing one submodule does not load `transformer`. A submodule's own name and
    dunders are left to the import system.
    """
    if name.startswith("__") or (Path(__file__).parent / f"{name}.py").exists():
        raise AttributeError(f"module 'midlayer.model' has no attribute {name!r}")
    for old in ("midlayer.model.transformer", "midlayer.model.layers"):  # the old module's names, now in two
        # imported on first use: no start-up cost for the other submodules
        module = importlib.import_module(old)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'midlayer.model' has no attribute {name!r}")

"""midlayer: cheaper Transformers by working on their middle layers.

    import midlayer
    llm = midlayer.LLM.load("smollm2-135m", weights="q4")
    print(llm.generate([{"role": "user", "content": "Hello!"}]).text)

`LLM` and `Completion` (midlayer/api.py) are imported on first use, so `import midlayer` stays light.
"""
import importlib

from . import compat

__version__ = "0.1.0"

compat.install()

_API = ("LLM", "Completion")


def __getattr__(name: str) -> object:
    if name in _API:  # imported on first use: no start-up cost for `import midlayer.<submodule>`
        return getattr(importlib.import_module("midlayer.api"), name)
    raise AttributeError(f"module 'midlayer' has no attribute {name!r}")


__all__ = ["LLM", "Completion", "__version__"]

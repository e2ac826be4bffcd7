"""Old import paths keep working: the flat modules of midlayer <= 0.1 (before issue 44's subpackages).

`import midlayer.drafters`, `from midlayer.pretrained import load_pretrained` and `python -m midlayer.distill`
resolve to the module's new home, as the *same* module object (so monkeypatching either name patches both).
The four old modules whose names are now subpackages (`midlayer.data`, `model`, `train`, `speculative`) keep
their names through each package's `__getattr__`. Checkpoints and draft files pickle no class paths, so they
need nothing from here.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import CodeType, ModuleType
from typing import Callable, Sequence

# old module -> new module
OLD_PATHS: dict[str, str] = {f"midlayer.{old}": f"midlayer.{new}" for old, new in {
    "kernels": "ops.kernels",
    "corpus": "data.corpus", "tokenizer": "data.tokenizer", "fineweb": "data.fineweb", "prompts": "data.prompts",
    "prompt_recipe": "data.prompt_recipe", "pretrained_tokenizer": "data.pretrained_tokenizer",
    "attention": "model.attention", "gating": "model.gating", "ssm": "model.ssm", "flops": "model.flops",
    "sparsity": "model.sparsity", "kv_cache": "model.kv_cache",
    "evaluate": "train.evaluate", "checkpoint": "train.checkpoint", "distributed": "train.distributed",
    "generate": "engine.generate", "decode_step": "engine.decode_step", "quantization": "engine.quantization",
    "pretrained": "engine.pretrained",
"eagle": "speculative.eagle", "hidden_transfer": "speculative.hidden_transfer",
    "skip_gates": "speculative.skip_gates", "tree_cost": "speculative.tree_cost", "distill": "speculative.distill",
    "draft_training": "speculative.draft_training", "draft_vocab": "engine.draft_vocab",
    "sweep": "experiments.sweep", "plot": "experiments.plot", "bench": "experiments.bench",
    "static_bench": "experiments.static_bench", "demo": "experiments.demo",
}.items()}


# old module -> the new modules its names went to (a module split in two or more), searched in order
SPLIT_PATHS: dict[str, tuple[str, ...]] = {
    "midlayer.drafters": ("midlayer.speculative.registry", "midlayer.speculative.drafting",
                          "midlayer.speculative.medusa", "midlayer.speculative.early_exit",
                          "midlayer.speculative.layer_skip", "midlayer.train.evaluate"),
}


def names_from(name: str, modules: Sequence[str], submodules: Sequence[str] = ()
               ) -> Callable[[str], object]:
    """A module `__getattr__` (PEP 562) for module `name` that finds a missing attribute in `modules`, in order,
    importing them on first use (so importing one submodule of a package does not load the others). Dunders
    and the package's own `submodules` are left to the import system."""

    def __getattr__(attr: str) -> object:
        if not attr.startswith("__") and attr not in submodules:
            for new in modules:
                module = importlib.import_module(new)
                if hasattr(module, attr):
                    return getattr(module, attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    return __getattr__


def old_names(package: str, path: str, modules: Sequence[str]) -> Callable[[str], object]:
    """`names_from` for a package that took the name of an old module (`midlayer.data`, `model`, `train`,
    `speculative`): the old module's names come from `modules`; `path` is the package's `__init__.py`."""
    return names_from(package, modules, [p.stem for p in Path(path).parent.glob("*.py")])


def split_module(name: str) -> ModuleType:
    """A module `name` whose attributes are looked up, on first use, in the modules its names went to."""
    module = ModuleType(name, f"Old path of {', '.join(SPLIT_PATHS[name])} (midlayer.compat).")
    module.__getattr__ = names_from(name, SPLIT_PATHS[name])  # type: ignore[attr-defined]
    return module


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """A meta-path finder and loader that binds an old module name to the new module object."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in OLD_PATHS and fullname not in SPLIT_PATHS:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if spec.name in SPLIT_PATHS:
            return split_module(spec.name)
        return importlib.import_module(OLD_PATHS[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module has run already

    def get_source(self, fullname: str) -> str:
        # `python -m midlayer.distill`: run the new module as __main__, in its own package
        return f"import runpy\nrunpy.run_module({OLD_PATHS[fullname]!r}, run_name='__main__', alter_sys=True)\n"

    def get_code(self, fullname: str) -> CodeType:
        return compile(self.get_source(fullname), f"<{fullname} -> {OLD_PATHS[fullname]}>", "exec")


def install() -> None:
    """Put the finder on sys.meta_path once (after the standard finders, so real modules always win)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder())

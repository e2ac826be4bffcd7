"""The Transformer: layers, attention and its one mask rule, the skip-middle gates and routers (arXiv
2506.21103), their sparsity controllers, the SSM mixer, the KV-cache views the blocks read and write, and the
FLOPs model as pure functions beside it.

May import `common`, `ops`, `config` and `data`. Nothing here trains, decodes or drafts.
"""
from midlayer import compat

# `from midlayer.model import X`: the names of the old module `midlayer.model`, looked up on first
# use in the modules they now live in, so that importing one submodule does not load the others
__getattr__ = compat.old_names(__name__, __file__, ('midlayer.model.transformer', 'midlayer.model.layers'))

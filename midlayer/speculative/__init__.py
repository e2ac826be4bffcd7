"""Lossless speculative decoding: the draft tree and its verification loop, the drafters (Medusa, early exit,
layer skip and learned skip gates, EAGLE / EAGLE-2, hidden transfer of arXiv 2404.12022), the draft file
registry, the tree-cost model that prices a round, self-distillation data and draft training.

May import every layer below it. The `Drafter` protocol in `protocol.py` is what the loop and the cost model
see of a drafter.
"""
from midlayer import compat

# `from midlayer.speculative import X`: the names of the old module `midlayer.speculative`, looked up on first
# use in the modules they now live in, so that importing one submodule does not load the others
__getattr__ = compat.old_names(__name__, __file__, ('midlayer.speculative.verify',))

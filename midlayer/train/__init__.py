"""Training: the one training loop (its named steps), evaluation, checkpoints that pickle no class paths, and
the torchrun process group (DDP / FSDP2, one code path for 1 and N processes).

May import everything below it: `common`, `ops`, `config`, `data`, `model`.
"""
from midlayer import compat

# `from midlayer.train import X`: the names of the old module `midlayer.train`, looked up on first
# use in the modules they now live in, so that importing one submodule does not load the others
__getattr__ = compat.old_names(__name__, __file__, ('midlayer.train.loop',))

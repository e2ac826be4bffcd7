"""Text in, token ids out: the embedded corpus, the BPE tokenizer, token shards and their windows, the
FineWeb-Edu path, pretrained models' tokenizers and chat templates, and the prompt sets (and their recipe) that
draft training self-distils from.

May import `common` and `ops`. Knows nothing of models: a shard is a file of token ids.
"""
from midlayer import compat

# `from midlayer.data import X`: the names of the old module `midlayer.data`, looked up on first
# use in the modules they now live in, so that importing one submodule does not load the others
__getattr__ = compat.old_names(__name__, __file__, ('midlayer.data.shards',))

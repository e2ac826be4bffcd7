"""Compute kernels, the leaf of the package: CPU feature detection, the batch-invariant C kernels of the q4
format (`csrc/`, built once into the user cache), their weight formats, GEMMs and attention.

Owns everything that talks to the hardware below PyTorch. May import only `common`: the model, the engine
and the drafters call down into it, never the other way.
"""

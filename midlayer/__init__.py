"""midlayer: cheaper Transformers by working on their middle layers."""

__version__ = "0.1.0"

"""midlayer: cheaper Transformers by working on their middle layers."""
from . import compat

__version__ = "0.1.0"

compat.install()

"""compressed-opt: communication-compressed optimizers for PyTorch data-parallel training."""
from compressed_opt import comm, cuda  # noqa: F401

__version__ = "0.1.0"

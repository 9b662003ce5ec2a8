"""vmapdp: per-sample gradients and DP training for PyTorch, as pure functions."""

from vmapdp.errors import UnsupportedModuleError

__version__ = "0.1.0"

__all__ = ["UnsupportedModuleError"]

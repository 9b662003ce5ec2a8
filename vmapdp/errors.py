"""Exceptions raised by vmapdp."""

from __future__ import annotations


class UnsupportedModuleError(ValueError):
    """A module cannot be used for per-sample gradients / DP training as it is.

    Raised for modules that mix samples within a batch (train-mode BatchNorm), that
    update buffers from the data during the forward pass (running statistics), or that
    ``torch.func.vmap`` cannot batch. The message names the module and the fix;
    ``vmapdp.fix(module)`` returns a repaired copy where one exists.
    """

"""vmapdp: per-sample gradients and differentially private training for PyTorch, as pure functions.

A model becomes a pure function of ``(params, buffers, inputs)`` (:func:`functionalize`);
per-sample gradients are ``vmap(grad(loss_fn))`` (:func:`per_sample_grads`); clipping, noise,
accounting and sampling are pure functions over pytrees that compose into a DP-SGD step.
"""

from vmapdp import _tree  # noqa: F401  (first: it fixes the order in which dicts flatten; see its docstring)
from vmapdp import accounting, data, datasets, hf, mf, nn, optim, sharded_checkpoint, sharding, testing
from vmapdp.checkpoint import load_state, save_state
from vmapdp.clipping import (
    clip_and_sum,
    clip_and_sum_per_layer,
    clip_factors,
    clip_per_sample,
    grad_norms,
    per_layer_sensitivity,
)
from vmapdp.curvature import (
    empirical_fisher_diag,
    empirical_ntk,
    grad_similarity,
    hutchinson_trace,
    influence_scores,
    per_sample_gnvp,
    per_sample_hessian,
    per_sample_hvp,
    per_sample_jacobian,
)
from vmapdp.errors import PublicSeedWarning, UnsupportedModuleError
from vmapdp.functional import FunctionalModel, functionalize
from vmapdp.clipped import clipped_grad_sum
from vmapdp.noise import add_noise, make_generator
from vmapdp.per_sample import per_sample_grad_norms, per_sample_grads
from vmapdp.precision import mixed_precision
from vmapdp.private import PrivateTrainer, make_private
from vmapdp.adaptive import AdaptiveClipping
from vmapdp.train import PrivacyBudgetExceeded, TrainState, init_train_state, make_train_step
from vmapdp.validation import Problem, explain_failure, fix, validate

__version__ = "0.1.0"

__all__ = [
    "functionalize",
    "FunctionalModel",
    "per_sample_grads",
    "per_sample_grad_norms",
    "mixed_precision",
    "grad_norms",
    "clip_factors",
    "clip_per_sample",
    "clip_and_sum",
    "clipped_grad_sum",
    "clip_and_sum_per_layer",
    "per_layer_sensitivity",
    "add_noise",
    "make_generator",
    "per_sample_hessian",
    "per_sample_hvp",
    "per_sample_jacobian",
    "per_sample_gnvp",
    "empirical_fisher_diag",
    "hutchinson_trace",
    "empirical_ntk",
    "grad_similarity",
    "influence_scores",
    "make_train_step",
    "AdaptiveClipping",
    "init_train_state",
    "TrainState",
    "PrivacyBudgetExceeded",
    "make_private",
    "PrivateTrainer",
    "save_state",
    "load_state",
    "validate",
    "fix",
    "Problem",
    "explain_failure",
    "UnsupportedModuleError",
    "PublicSeedWarning",
    "accounting",
    "optim",
    "data",
    "datasets",
    "nn",
    "hf",
    "mf",
    "sharding",
    "sharded_checkpoint",
    "testing",
]

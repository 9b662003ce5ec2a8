"""Privacy self-checks to run in your own test suite, on your own ``loss_fn`` and train step.

DP bugs are silent: a step that divides by the realised batch size, forgets to clip, shares one
dropout mask across the batch, samples fixed-size batches instead of Poisson ones, or adds
noise off by a factor of sqrt(2) trains normally and reports an epsilon that is false. Each check
here tests one property the privacy proof relies on, on the code you actually run::

    check_per_sample_independence(loss_fn, params, buffers, batch=batch)   # no cross-sample leaks
    check_sensitivity(step, state, batch, mask, buffers, lr=..., l2_clip_norm=..., expected_batch_size=...)
    check_noise_calibration(step, state, batch, mask, buffers, lr=..., l2_clip_norm=..., expected_batch_size=...)
    check_sampler(sampler)                                                 # Poisson(q), really
    check_ledger(before, after, steps=..., noise_multiplier=..., sample_rate=...)
    audit_epsilon_lower_bound(make_step)                                   # empirical epsilon <= claimed

Every check returns a small frozen report (``passed``, the figures, a readable ``str``) and, by
default, raises :class:`PrivacyCheckError` (an ``AssertionError``, so pytest shows it as a failed
assertion) naming what failed, the figures and the likely bug. Pass ``raise_on_failure=False`` to
get the failing report back instead.

Statistical checks have a stated false-alarm rate ``alpha``: a correct implementation fails with
probability at most about ``alpha`` (normal and Kolmogorov approximations; exact for the audit's
Clopper-Pearson bounds). Fix the seeds of your test so it is deterministic.

The step-level checks (sensitivity, noise) read the *parameter update* and assume plain SGD
(``vmapdp.optim.sgd`` without momentum) on the first step, where the update is exactly
``lr * noisy_sum / expected_batch_size``. Build a plain-SGD twin of your step for them; the
privacy of the step does not depend on the optimizer, which only post-processes the noisy sum.

One module per check: ``independence``, ``sensitivity``, ``noise``, ``sampler``, ``ledger`` and
``epsilon`` (the white-box audit, the only one that builds a train step); ``stats`` holds the
small statistics they share, ``runs`` the helpers for running a step on edited batches, and
``report`` the :class:`PrivacyCheckError` every check raises. :mod:`vmapdp.testing` is the
public door to the same names.
"""

from vmapdp.audit.epsilon import AuditReport, audit_epsilon_lower_bound
from vmapdp.audit.independence import IndependenceReport, check_per_sample_independence
from vmapdp.audit.ledger import LedgerReport, check_ledger
from vmapdp.audit.noise import NoiseReport, check_noise_calibration
from vmapdp.audit.report import PrivacyCheckError
from vmapdp.audit.sampler import SamplerReport, check_sampler
from vmapdp.audit.sensitivity import SensitivityReport, check_sensitivity
from vmapdp.audit.stats import clopper_pearson_upper

__all__ = [
    "PrivacyCheckError",
    "IndependenceReport",
    "SensitivityReport",
    "NoiseReport",
    "SamplerReport",
    "LedgerReport",
    "AuditReport",
    "check_per_sample_independence",
    "check_sensitivity",
    "check_noise_calibration",
    "check_sampler",
    "check_ledger",
    "audit_epsilon_lower_bound",
    "clopper_pearson_upper",
]

"""The clipped sum of per-sample gradients straight from a one-sample loss, by one of three exact
methods (``vmap``, ``ghost``, ``two_pass``) or ``auto``, which races those that apply once per input shape.

``clipped_grad_sum(loss_fn, l2_clip_norm=C, method=...)`` is a :class:`ClippedGradSum`: a frozen
dispatcher that carries what the noise needs (``l2_sensitivity``). :class:`AutoChooser` is
``"auto"``'s one policy (candidates, race, cache per shape), used here and by ``make_train_step``,
which adds replay from the state and rank 0's choice when distributed. The maths of the methods
live elsewhere: ``clip_and_sum`` (clipping.py), ``per_sample_grads`` (per_sample.py), ghost
clipping (the ``vmapdp.ghost`` package).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import types
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import optree
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from vmapdp import _checks
from vmapdp._tree import batch_size, check_mask
from vmapdp.clipping import check_rule, clip_and_sum, clip_factors, released_rows
from vmapdp.errors import UnsupportedModuleError
from vmapdp.functional import rng_kept
from vmapdp.ghost import limits
from vmapdp.ghost.engine import ghost_norms_and_sum
from vmapdp.ghost.plan import Plan, coverage, probe
from vmapdp.per_sample import EXPLAINED, check_on_one_sample, check_reads_its_sample, per_sample_grads, raise_explained, refuse_writes, watch_writes
from vmapdp.precision import full_float32

__all__ = ["clipped_grad_sum", "ClippedGradSum", "AutoChooser", "METHODS", "auto_candidates", "race", "shape_key", "eager_profile", "EagerProfile"]

METHODS = ("auto", "vmap", "ghost", "two_pass")
RACE_MARGIN = 0.1  # race keeps the earliest-listed candidate within this fraction of the fastest
RACE_SECONDS, RACE_MAX_ROUNDS = 0.25, 20  # race times more rounds (up to the max) while it has spent less than this


def auto_candidates(plan: Plan | None, params: dict[str, Tensor], batch_rows: int, norm_chunk_size: int | None = None) -> list[str]:
    """The exact methods ``"auto"`` times for a batch of ``batch_rows``, in order of preference (the
    race keeps the first within ``RACE_MARGIN`` of the fastest): ``"ghost"`` when it covers any
    param; ``"vmap"`` when its per-sample grads fit ``Limits.auto_vmap_elements``; where they do
    not, ``"two_pass"`` (the per-sample grads of ``norm_chunk_size`` samples at a time, default
    :func:`two_pass_chunk`) when its chunk is smaller than the batch (a large model: GPT-2 small full fine-tuning on a CPU ran at
    1.23x the non-private step's time and 0.76x its memory, against ghost's 1.96x and 1.38x);
    and ``"vmap"`` when nothing else applies."""
    out = ["ghost"] if plan is not None and coverage(plan, params) > 0 else []
    if batch_rows * sum(v.numel() for v in params.values()) <= limits.LIMITS.auto_vmap_elements:
        out.append("vmap")
    elif (norm_chunk_size or two_pass_chunk(params)) < batch_rows:
        out.append("two_pass")
    elif not out:
        out.append("vmap")
    return out


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on an accelerator (a no-op on the CPU)."""
    sync = getattr(getattr(torch, device.type, None), "synchronize", None) if device.type != "cpu" else None
    if sync is not None:
        sync()


def _elapsed(name: str, run: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``run`` takes in a race (tests replace this function and time by name)."""
    del name
    return _seconds(run, device)


def _seconds(run: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``run`` takes (the device synchronised before and after)."""
    _synchronize(device)
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start


def _out_of_memory(err: BaseException) -> bool:
    # (MemoryError: check_per_sample_grads_fit's refusal, before anything ran)
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(err)


def race(runs: dict[str, Callable[[], Any]], device: torch.device) -> str:
    """The name of the fastest of ``runs`` (zero-argument calls of exact methods on the same chunk).

    Each is called once to warm up (and compile, when compiled), then ``Limits.auto_rounds`` times in
    turn, and more rounds (up to ``RACE_MAX_ROUNDS``) while the timed calls have taken less than
    ``RACE_SECONDS`` in all (millisecond steps: one descheduling on a loaded machine otherwise
    decided the race); the best time of each decides, and of the candidates within ``RACE_MARGIN`` (10%) of the
    fastest the one listed first wins: timings that close flip with the machine's load, and a
    choice that flips between two processes misses the compile cache the first one filled. The
    results are dropped: nothing is released. The global
    RNGs (CPU and ``device``'s) are restored afterwards, so random layers (dropout) draw in the
    step as if no race had run. A candidate that runs out of memory drops out (unless it is the
    last one).
    """
    if len(runs) == 1:
        return next(iter(runs))
    runs = dict(runs)
    with rng_kept(device):
        for name in list(runs):
            try:
                runs[name]()
            except (RuntimeError, MemoryError) as err:
                if not _out_of_memory(err) or len(runs) == 1:
                    raise
                del runs[name]
        best = {name: math.inf for name in runs}
        rounds, spent = 0, 0.0
        while rounds < limits.LIMITS.auto_rounds or (spent < RACE_SECONDS and rounds < RACE_MAX_ROUNDS):
            for name, run in runs.items():
                seconds = _elapsed(name, run, device)
                best[name], spent = min(best[name], seconds), spent + seconds
            rounds += 1
    floor = min(best.values())
    return next(name for name, t in best.items() if t <= floor * (1 + RACE_MARGIN))


# ops Inductor leaves as calls to their ATen kernels (on the CPU: oneDNN, BLAS, ATen's sort): compiling a
# graph cannot make these faster, only what lies between them
_KERNEL_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "convolution", "convolution_backward", "mm", "bmm", "addmm", "baddbmm", "addbmm", "sort",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    )
    if hasattr(torch.ops.aten, name)
)


class _KernelClock(TorchDispatchMode):
    """Seconds spent in :data:`_KERNEL_OPS` (CPU tensors: the calls are synchronous), per op, and
    the number of ATen ops dispatched in all."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.overloadpacket not in _KERNEL_OPS:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out


class EagerProfile(NamedTuple):
    """What one eager call of a step says of compiling it (see :func:`eager_profile`)."""

    kernel_share: float  # the share of its time in kernels Inductor calls as they are, in [0, 1]
    ops: int  # the ATen ops it dispatched: the size of the graph a compile would trace and lower


def eager_profile(run: Callable[[], Any], device: torch.device, *, breakdown: dict[str, float] | None = None) -> EagerProfile:
    """What compiling ``run`` (CPU) could gain and cost, from eager calls of it.

    ``kernel_share``: the share of one call spent in kernels that ``torch.compile`` calls as they
    are (convolutions forward and backward, matrix products, sorts): what a compiled run could at
    best take off is the rest. The best of two plain calls is the whole, the best of two calls
    under a dispatch mode that times those kernels the part (best of each, so that a descheduling
    on a loaded machine does not inflate either), all on one thread: on a loaded machine each
    multi-threaded kernel also waits until all its threads get a core, which took a tiny GPT-2's
    0.2 to over 0.65 (one thread: 0.18-0.22 idle; the CIFAR-10 CNN 0.73-0.90, MNIST 0.25-0.54, at
    batch 16 and 128). ``ops``: the ATen ops one call dispatched (after ``vmap`` and ``grad``
    turned it into batched ops), which compile time grows with: dynamo traces them, Inductor
    lowers and schedules them and builds their kernels (see ``Limits.compile_max_ops``).
    ``breakdown``, if given, gets that call's seconds per kernel op. The global RNGs are restored,
    as in :func:`race`; the results are dropped."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (under load, a parallel kernel waits for each of its threads to get a core: shares near 1)
    try:
        with rng_kept(device):
            whole = min(_seconds(run, device) for _ in range(2))
            clocks = []
            for _ in range(2):
                clocks.append(_KernelClock())
                with clocks[-1]:
                    run()
    finally:
        torch.set_num_threads(threads)
    clock = min(clocks, key=lambda c: sum(c.seconds.values()))
    if breakdown is not None:
        breakdown.update(clock.seconds)
    share = min(1.0, sum(clock.seconds.values()) / whole) if whole > 0 else 0.0
    return EagerProfile(share, clock.ops)


_PLANS_KEPT = 64  # plans (and one-sample checks) a ClippedGradSum keeps, the most recent


def shape_key(args: tuple) -> tuple:
    """What ``"auto"``'s choice and a step's record of it depend on: the arguments' leaves by path
    (param names included), shapes, dtypes; other leaves by value (an int may choose the layers
    run), floats by type alone: a float that changes at each call (a temperature) must not make a
    new race and state record each time (found by review). (Plans and the one-sample check are
    keyed by the floats' values too: ``_keys``.)

    Sorted by path, so that the key does not depend on the order optree lists dict entries in.
    """
    return _keys(args)[0]


def _keys(args: tuple) -> tuple[tuple, tuple]:
    """``(shape_key(args), plan key)``: the plan key adds the floats' values, since a float may
    change the ops the loss runs or which tensors they read (found by review: a flag above 0.5
    made the loss read a captured dataset row, whose site looked the same to ghost's plan)."""
    paths, leaves, _ = optree.tree_flatten_with_path(args, namespace="torch")
    key = tuple(sorted((repr(p), _leaf_key(t)) for p, t in zip(paths, leaves)))
    floats = tuple(sorted((repr(p), t) for p, t in zip(paths, leaves) if isinstance(t, float)))
    return key, ((key, floats) if floats else key)


def _watched(params: Any, shared: tuple) -> list:
    """Eagerly, the version counters a vmap or two_pass run must leave as they are: a write made on
    some calls only escapes the one-sample check (found by review: a counter written every third
    call). Compiled, nothing (the check before the first compiled run covers what it can)."""
    return [] if torch.compiler.is_compiling() else watch_writes(params, shared)


def _leaf_key(t: Any) -> tuple:
    if isinstance(t, Tensor):
        return (tuple(t.shape), t.dtype, t.device.type)
    if isinstance(t, float):
        return ("float",)
    return (type(t).__name__, repr(t))


class AutoChooser:
    """``"auto"``'s choice per input shape: the fastest of the candidates, raced once, then cached.

    ``agree(pick) -> name`` (optional) turns the local choice ``pick()`` into a shared one: a
    distributed step calls ``pick`` on every rank and runs rank 0's answer everywhere, and where
    ``pick`` raised on any rank, every rank raises (none is left waiting in a collective). ``chosen``
    is a read-only view of the choices so far.
    """

    def __init__(self, agree: Callable[[Callable[[], str]], str] | None = None):
        self._chosen: dict[tuple, str] = {}
        self._agree = agree
        self.chosen: Mapping[tuple, str] = types.MappingProxyType(self._chosen)

    def choose(self, key: tuple, pick: Callable[[], str]) -> str:
        """The method for ``key``: the cached one, or ``pick()``'s (a :func:`race` of the candidates),
        agreed where there is ``agree``."""
        if key not in self._chosen:
            self._chosen[key] = pick() if self._agree is None else self._agree(pick)
        return self._chosen[key]

    def get(self, key: tuple) -> str | None:
        """The method chosen for ``key``, or None."""
        return self._chosen.get(key)

    def replay(self, key: tuple, name: str) -> str:
        """Record ``name`` for ``key`` without a race (a choice replayed from a saved state)."""
        self._chosen.setdefault(key, name)
        return self._chosen[key]


def clipped_grad_sum(
    loss_fn: Callable[..., Tensor],
    *,
    l2_clip_norm: float,
    method: str = "auto",
    rule: str = "clip",
    stability: float = 0.01,
    nonfinite: str = "zero",
    randomness: str = "error",
    norm_chunk_size: int | None = None,
) -> "ClippedGradSum":
    """The clipped sum of per-sample gradients straight from a one-sample loss.

    ``fn = clipped_grad_sum(loss_fn, l2_clip_norm=C)`` and ``fn(params, *shared, batch, mask=None)``
    return ``(summed, norms, losses)``: exactly what ``clip_and_sum(per_sample_grads(loss_fn)(...),
    C, mask=mask)`` gives (float rounding aside), plus the per-sample losses, computed by one of:

    * ``"vmap"``: per-sample gradients (``vmap(grad)``), then :func:`vmapdp.clip_and_sum`.
      Memory ``B x params``; works for every model.
    * ``"ghost"``: per-sample norms from layer inputs and output gradients and the clipped sum by
      book-keeping (see this module's docstring): one forward and one backward, no per-sample
      gradients for linear, conv and embedding weights. Memory: non-private training's plus every
      covered layer's output gradients (measured in benchmarks/memory.py).
    * ``"two_pass"``: per-sample grads by the vmap engine, ``norm_chunk_size`` samples at a time
      (default: as many as keep them under ``Limits.two_pass_elements``, 2 GiB in float32, at
      least one; :func:`two_pass_chunk`); each chunk is clipped and added to the sum before the
      next is computed. Peak memory ``norm_chunk_size x (params + one sample's activations)``, for
      any model, dropout included.
      The sum is of the very per-sample grads whose norms were clipped, as with ``"vmap"``. (It
      used to take the sum from one batched backward of ``sum_i w_i loss_i``: that backward's
      rounding is relative to the whole batch, so in bfloat16 one benign sample moved the update
      by 32 C, in float32 a sample with cancelling terms moved the others' by 1.015 C, and ops
      whose batched backward couples samples, such as ``scale_grad_by_freq``, broke the bound.)
    * ``"auto"`` (default): the fastest of the methods that apply (:func:`auto_candidates`) for
      this model and batch, timed on the first call for each input shape (each run once to warm
      up, then at least twice; see :func:`race`): ``"ghost"`` when it covers any param, ``"vmap"``
      while its per-sample grads fit 256 MiB, ``"two_pass"`` (default chunk) where they do not and
      its chunk is smaller than the batch. ``fn.chosen_methods`` holds the choices (a read-only view). The methods agree
      up to float rounding; for bitwise-reproducible runs (and resumes) name the method. Traced
      by ``torch.compile`` before any eager call, nothing can be timed: the graph then runs
      ``"ghost"`` where it covers a param (call ``fn`` once eagerly first to race).

    Every method gives each sample's contribution a norm ``<= C`` (up to float rounding), and
    the released sums of neighbouring batches (with and without one sample) differ by at most
    ``C (1 + tol)``, with ``tol`` ``clip_and_sum``'s float32 summation rounding (``~ 2 B**2 eps``
    worst case; ghost: see ``vmapdp.ghost.engine._sum_dtype``; tests/test_sensitivity.py checks it with crafted
    samples), and drops masked and non-finite rows exactly (see :func:`vmapdp.clip_and_sum` for ``rule``, ``stability`` and ``nonfinite``).

    Returns a :class:`ClippedGradSum`: call it, ``fn.prepare(*args)`` to plan a shape outside
    ``torch.compile``, ``fn.l2_sensitivity`` for the noise scale. Compiled directly, the loss's
    eager checks (it reads its sample and the params, writes into none of its inputs) run once per
    shape, at ``prepare`` or the first call; what changes later under the compiled graph only
    (a write made on later calls, a flag outside the arguments) is not seen. ``make_train_step``
    watches each compiled call and checks again whenever torch.compile traces anew: prefer it.
    Every instance runs the same ``__call__`` code, so torch.compile keeps one cache entry per
    instance there: compiling more than ``torch._dynamo.config.cache_size_limit`` (8) instances in
    one process (a sweep over clip norms, say) hits its recompile limit (found by review);
    ``make_train_step`` compiles a fresh function per step and is not limited so. Ghost drops a
    sample whose norm overflows to inf as non-finite (inputs beyond about 1e19: ``inf * 0``) where
    ``"vmap"`` may still compute a finite norm: safe, but the methods then differ.
    """
    call = "clipped_grad_sum(loss_fn)"
    _checks.loss_function(call, loss_fn)
    _checks.choice(call, "method", method, METHODS)
    check_rule(call, rule, stability, nonfinite)
    _checks.clip_norm(call, "l2_clip_norm", l2_clip_norm)
    _checks.optional_positive_int(call, "norm_chunk_size", norm_chunk_size)
    return ClippedGradSum(loss_fn, l2_clip_norm, method, rule, stability, nonfinite, randomness, norm_chunk_size)


_CALL = "clipped_grad_sum(loss_fn)"


def _sunk(result: tuple[dict[str, Tensor], Tensor, Tensor], sink: Callable[[str, Tensor], Tensor] | None) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """``result`` with each sum given to ``sink`` (None: as it is)."""
    summed, norms, losses = result
    return (summed if sink is None else {k: sink(k, v) for k, v in summed.items()}), norms, losses


def two_pass_chunk(params: Any) -> int:
    """``"two_pass"``'s default chunk: as many samples as keep their per-sample grads (one copy of
    ``params`` each) under ``Limits.two_pass_elements``, at least one."""
    elements = sum(p.numel() for p in optree.tree_leaves(params, namespace="torch"))
    return max(1, limits.LIMITS.two_pass_elements // max(elements, 1))


def available_bytes(device: torch.device) -> int | None:
    """Memory that can still be allocated on ``device``: on CUDA the driver's free memory plus
    what PyTorch's allocator holds unused; on Linux (CPU) ``MemAvailable`` plus free swap from
    ``/proc/meminfo``; None where neither can be read (then nothing is checked)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2] and line.split()[1].isdigit()}
    except OSError:
        return None
    if "MemAvailable" not in info:
        return None
    return info["MemAvailable"] + info.get("SwapFree", 0)


def check_per_sample_grads_fit(call: str, method: str, rows: int, params: Any, *, copied: bool | Callable[[], bool] = False) -> None:
    """Refuse, before anything runs, per-sample grads that cannot fit the device's free memory.

    ``"vmap"`` forms the per-sample grads of all ``rows`` of its batch at once, ``"two_pass"`` of
    ``rows`` samples at a time (its chunk): ``rows`` copies of the params, whatever else the step
    needs. Past the free memory (``available_bytes``) the step could only fail, on Linux by the
    OOM killer with no message at all (found: GPT-2 small's batch of 32 under ``"two_pass"``
    without a chunk, 16 GB). ``copied``: a masked row makes clipping copy them once (zeroed rows),
    so twice that (a callable: asked only where it decides, since reading a mask on an
    accelerator waits for it). Nothing is checked where the free memory cannot be read."""
    leaves = optree.tree_leaves(params, namespace="torch")
    if rows <= 1 or not leaves:
        return
    per_sample = sum(p.numel() * p.element_size() for p in leaves)
    device = leaves[0].device
    free = available_bytes(device)
    if free is None or 2 * rows * per_sample <= free:
        return
    copied = copied() if callable(copied) else copied
    needed = rows * per_sample * (2 if copied else 1)
    if needed <= free:
        return
    fix = (
        f"pass norm_chunk_size={max(1, free // max(per_sample, 1) // 2)} or smaller (or leave it None: as many as fit Limits.two_pass_elements)"
        if method == "two_pass"
        else "use method='ghost' (no per-sample grads of covered layers), method='two_pass' (per-sample grads a chunk at a time), or a smaller physical_batch_size"
    )
    raise MemoryError(
        f"{call}: method={method!r} would form the per-sample grads of {rows} samples at once, {rows} x "
        f"{per_sample / 2**20:.1f} MiB{' (x 2: a masked row copies them)' if copied else ''} = {needed / 2**30:.2f} GiB, but {device} has {free / 2**30:.2f} GiB free: {fix}. "
        "Nothing was computed or released."
    )


_LATER_CHUNK = threading.local()  # (make_train_step: the later chunks of a step, whose first was checked)


@contextlib.contextmanager
def one_check_per_step(later: bool):
    """Within it (``later``), eager runs skip ``ClippedGradSum``'s per-call check that the loss
    reads its sample: ``make_train_step`` runs its later chunks of a step so, the first checked."""
    before = getattr(_LATER_CHUNK, "on", False)
    _LATER_CHUNK.on = later
    try:
        yield
    finally:
        _LATER_CHUNK.on = before


@dataclass(frozen=True, eq=False)
class ClippedGradSum:
    """``fn(params, *shared, batch, mask=None) -> (summed, norms, losses)``: see :func:`clipped_grad_sum`.

    Guarantees: each sample's contribution to ``summed`` has norm ``<= l2_clip_norm`` (up to float
    rounding), so adding or removing one sample moves ``summed`` by at most ``l2_sensitivity``;
    masked and non-finite rows contribute exactly nothing. The configuration is fixed; what
    changes is the cache of plans (one probe per input shape) and of ``"auto"``'s choices.
    """

    loss_fn: Callable[..., Tensor]
    l2_clip_norm: float
    method: str = "auto"
    rule: str = "clip"
    stability: float = 0.01
    nonfinite: str = "zero"
    randomness: str = "error"
    norm_chunk_size: int | None = None
    _plans: dict = field(default_factory=dict, repr=False)
    _auto: AutoChooser = field(default_factory=AutoChooser, repr=False)
    raise_later: bool = field(default=False, repr=False)  # (counting_nonfinite's twin: its caller raises on the count)
    _grads_fn: Callable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_grads_fn", per_sample_grads(self.loss_fn, return_loss=True, randomness=self.randomness))

    @property
    def l2_sensitivity(self) -> float:
        """The L2 sensitivity of the released sum under adding or removing one sample: every rule
        ('clip', and 'normalize' with ``C / (norm + stability)``) bounds a contribution by ``C``."""
        return self.l2_clip_norm

    @property
    def chosen_methods(self) -> Mapping[tuple, str]:
        """``"auto"``'s choice per input shape (a read-only view)."""
        return self._auto.chosen

    def prepare(self, *args: Any) -> Plan | None:
        """Learn (once per input shape) which ops see which params; call it outside torch.compile."""
        return self._planned(args)[1]

    def counting_nonfinite(self) -> ClippedGradSum:
        """For ``nonfinite="raise"`` under torch.compile, whose graph cannot branch on values: a
        twin that drops non-finite rows (``"zero"``), sharing this one's plans (the eager
        ``prepare`` made them), whose caller reads the count afterwards and raises
        (``raise_later``: make_train_step's compiled chunk)."""
        return dataclasses.replace(self, nonfinite="zero", _plans=self._plans, _auto=self._auto, raise_later=True)

    def recheck(self, *args: Any) -> None:
        """Run the eager one-sample check of the loss again, whatever was planned: a compiled caller
        calls it after torch.compile traced the loss anew (a guard on state outside the arguments
        failed: a flag may have changed what the loss reads; found by review)."""
        if batch_size(args[-1], call=_CALL) > 0:
            self._plan(args)

    def __call__(self, *args: Any, mask: Tensor | None = None, sink: Callable[[str, Tensor], Tensor] | None = None) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """``(summed, norms, losses)`` of ``fn(params, *shared, batch)``. ``sink(name, sum)``, if
        given, takes each param's clipped sum and ``summed`` holds what it returns: ghost clipping
        calls it as each sum is formed (the sharded step reduce-scatters there, so that the full
        sums never exist all at once), the other methods at the end."""
        try:
            summed, norms, losses = self._dispatch(args, mask, sink)
            return summed, norms, losses
        except EXPLAINED as err:
            if "saved tensor hooks" in str(err):
                raise UnsupportedModuleError(
                    f"{_CALL}: the loss uses torch.utils.checkpoint (or other saved tensor hooks), which "
                    "torch.func's grad/vjp (used by every method: vmap, ghost, two_pass) refuse: 'torch.func."
                    "{grad, vjp, ...} don't yet support saved tensor hooks'. Expected a loss without "
                    "checkpoint; to bound memory use physical_batch_size (make_train_step) or "
                    "method='two_pass' with a small norm_chunk_size instead."
                ) from err
            raise_explained(_CALL, err)  # (torch's raw vmap errors, found by review)

    def _dispatch(self, args: tuple, mask: Tensor | None, sink: Callable[[str, Tensor], Tensor] | None) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        if len(args) < 2:
            raise TypeError(f"{_CALL}: expected fn(params, *shared, batch, mask=None); got {len(args)} positional arguments.")
        params, shared, batch = args[0], tuple(args[1:-1]), args[-1]
        _checks.params_dict(_CALL, params, require_dict=False)
        if mask is not None:
            check_mask(mask, batch_size(batch, call=_CALL), call=_CALL)
        if self.method in ("vmap", "two_pass"):
            self._planned(args)  # (the loss checked once per shape, eagerly: traced, an eager call or prepare must have)
        if batch_size(batch, call=_CALL) == 0:
            return _sunk(self._by_vmap(params, shared, batch, mask), sink)
        if self.method == "vmap":
            self._reads_its_sample("vmap", args)
            return _sunk(self._by_vmap(params, shared, batch, mask), sink)
        # (compiled, the caller holds it open: make_train_step does, around the compiled chunk)
        eager = not torch.compiler.is_compiling()
        with full_float32(next(iter(params.values())).device.type) if eager else contextlib.nullcontext():
            if self.method == "two_pass":
                self._reads_its_sample("two_pass", args)
                return _sunk(self._by_two_pass(params, shared, batch, mask), sink)
            key, plan = self._planned(args)
            chosen = self._choose(key, plan, params, shared, batch, mask) if self.method == "auto" else "ghost"
            self._reads_its_sample(chosen, args)
            if chosen == "vmap":
                return _sunk(self._by_vmap(params, shared, batch, mask), sink)
            if chosen == "two_pass":
                return _sunk(self._by_two_pass(params, shared, batch, mask), sink)
            return self._by_ghost(params, shared, batch, mask, plan, sink)

    def _planned(self, args: tuple) -> tuple[tuple, Plan | None]:
        """This input shape's key (``shape_key``) and plan (ghost's; None for vmap and two_pass),
        made eagerly by ``_plan`` once per shape and floats' values. Under torch.compile a shape not
        planned eagerly is refused."""
        if batch_size(args[-1], call=_CALL) == 0:
            return (), None
        key, plan_key = _keys(args)
        if self.nonfinite == "raise" and torch.compiler.is_compiling():
            raise ValueError(
                f"{_CALL}: nonfinite='raise' cannot run inside a torch.compile graph (whether to raise depends on the "
                "values; found by review: every call failed with torch's data-dependent-guard error). Compile "
                "fn.counting_nonfinite() instead, which drops such rows, and raise on the norms it returns (non-finite "
                "where a row was dropped), outside the graph; make_train_step(nonfinite='raise', compile=True) does so."
            )
        if plan_key not in self._plans:
            if torch.compiler.is_compiling():
                raise ValueError(
                    f"{_CALL}: traced by torch.compile (method={self.method!r}) for an input shape it has not seen eagerly: "
                    "the checks of the loss on one sample (that it depends on its sample and on the params, and writes into "
                    "none of its inputs) cannot run under the tracer. Call fn.prepare(params, *shared, batch) (or fn once) "
                    "eagerly first with batches of that shape; make_train_step does so itself."
                )
            plan = self._plan(args)
            if len(self._plans) >= _PLANS_KEPT:  # (the oldest dropped: a float that changes at each call makes a key per call)
                del self._plans[next(iter(self._plans))]
            self._plans[plan_key] = plan
        return key, self._plans[plan_key]

    @torch.compiler.disable  # (found by review: torch.compile without fullgraph ran _planned eagerly but traced this, skipping its checks)
    def _plan(self, args: tuple) -> Plan | None:
        """The loss run eagerly on one sample with ``check_on_one_sample``'s refusals; for ghost and
        auto as ghost's probe, which returns the plan. The probe runs on copies of the params: a write
        it refuses only once it has landed (a view it does not follow) leaves the caller's unchanged."""
        params, shared, batch = args[0], tuple(args[1:-1]), args[-1]
        if self.method in ("vmap", "two_pass"):
            check_on_one_sample(_CALL, params, shared, batch, self.randomness, lambda p, s, x: self.loss_fn(p, *s, x))
            return None
        return probe(self._ghost_form[1], params, shared, batch, self.randomness, call=_CALL)

    def _reads_its_sample(self, method: str, args: tuple) -> None:
        """Before an eager run of ``method`` whose own check that the loss depends on its sample is
        blurred, that check on one sample (``check_reads_its_sample``: one forward on one row):
        under per-sample random draws (a dropout mask is batched on its own), and for every ghost
        run (its taps make everything after a covered layer batched, and its per-sample copies of
        params it does not cover everything after their use: ``Plan.batched`` stays, as a second
        line). vmap and two_pass otherwise check it themselves, on the per-sample losses; a compiled
        run is checked again whenever it is traced anew. It is a call of the loss of its own,
        before the run: a loss that changes what it reads between two calls by itself (a call
        counter, Python's ``random``) is not caught. ``make_train_step`` checks the first chunk of
        each step only (``one_check_per_step``). Cost, measured 2026-11-29 (eager, 2 cores): a
        tiny GPT-2 with dropout (16 x 64 tokens) +9-14% with ghost, +6-16% with vmap; a CNN at batch
        128 +8%; the IMDb LSTM 16.5 ms against its 325 ms ghost step at batch 128."""
        if torch.compiler.is_compiling() or getattr(_LATER_CHUNK, "on", False):
            return
        if self.randomness == "different" or method == "ghost":
            check_reads_its_sample(_CALL, self.loss_fn, args[0], tuple(args[1:-1]), args[-1], self.randomness)

    def _choose(self, key: tuple, plan: Plan | None, params, shared, batch, mask) -> str:
        """``"auto"``'s method for this input shape (while tracing for torch.compile nothing can be
        timed: then ghost if it covers any param)."""
        known = self._auto.get(key)
        if known is not None:
            return known
        names = auto_candidates(plan, params, batch_size(batch, call=_CALL), self.norm_chunk_size)
        if torch.compiler.is_compiling():
            return names[0]
        if self.randomness != "error":  # random layers draw differently under each method: the first, untimed, in every process
            return self._auto.replay(key, names[0])
        runs = {
            "ghost": lambda: self._by_ghost(params, shared, batch, mask, plan, None),
            "vmap": lambda: self._by_vmap(params, shared, batch, mask),
            "two_pass": lambda: self._by_two_pass(params, shared, batch, mask),
        }
        return self._auto.choose(key, lambda: race({m: runs[m] for m in names}, next(iter(params.values())).device))

    def _weights(self, norms: Tensor) -> Tensor:
        return clip_factors(norms, self.l2_clip_norm, rule=self.rule, stability=self.stability)

    def _fits(self, method: str, rows: int, params, mask) -> None:
        """``check_per_sample_grads_fit`` where per-sample grads are formed (every route: the named
        method, ``auto``'s race), host-side: never while tracing."""
        if not torch.compiler.is_compiling():
            check_per_sample_grads_fit(_CALL, method, rows, params, copied=lambda: mask is not None and not bool(mask.all()))

    def _by_vmap(self, params, shared, batch, mask):
        self._fits("vmap", batch_size(batch, call=_CALL), params, mask)
        watched = _watched(params, shared)
        grads, losses = self._grads_fn(params, *shared, batch, mask=mask)
        refuse_writes(_CALL, watched)
        summed, norms = clip_and_sum(grads, self.l2_clip_norm, mask=mask, rule=self.rule, stability=self.stability, nonfinite=self.nonfinite)
        return summed, norms, losses

    def _by_two_pass(self, params, shared, batch, mask):
        # Per-sample grads norm_chunk_size rows at a time, each chunk clipped and added to the sum
        # at once: the sum is of the very numbers whose norms were clipped (as vmap's), so every
        # bound of clip_and_sum holds. (It used to be one batched backward of the reweighted
        # losses, whose rounding is relative to the whole batch, and ops such as
        # scale_grad_by_freq coupled the samples in it.)
        b = batch_size(batch, call=_CALL)
        size = self.norm_chunk_size or two_pass_chunk(params)
        self._fits("two_pass", min(b, size), params, mask)
        real = torch.ones(b, dtype=torch.bool) if mask is None else mask
        norms, losses, summed = [], [], None
        watched = _watched(params, shared)
        for s in range(0, b, size):
            chunk = optree.tree_map(lambda t: t[s : s + size], batch, namespace="torch")
            g, lo = self._grads_fn(params, *shared, chunk)
            part, n = clip_and_sum(g, self.l2_clip_norm, mask=real[s : s + size], rule=self.rule, stability=self.stability, nonfinite="zero")
            summed = part if summed is None else {k: summed[k] + part[k] for k in summed}
            norms.append(n)
            losses.append(lo)
            g = part = None  # one chunk's per-sample grads at a time (not `del`: part is a closure cell, whose del dynamo cannot trace)
        refuse_writes(_CALL, watched)
        norms_t = torch.cat(norms)
        if self.nonfinite == "raise":  # (after all chunks: the error names the rows of the whole batch)
            released_rows(norms_t, real.to(norms_t.device), self.nonfinite, _CALL)
        return summed, norms_t, torch.where(real.to(norms_t.device), torch.cat(losses), 0.0)

    def _by_ghost(self, params, shared, batch, mask, plan, sink):
        grad_scale, loss_fn = self._ghost_form
        try:
            if grad_scale == 1.0:
                norms, summed, losses = ghost_norms_and_sum(loss_fn, params, shared, batch, mask, self._weights, randomness=self.randomness, plan=plan, call=_CALL, sink=sink)
            else:
                norms, summed, losses = ghost_norms_and_sum(
                    loss_fn, params, shared, batch, mask, lambda n: self._weights(n / grad_scale), randomness=self.randomness, plan=plan, call=_CALL, sink=sink
                )
                norms, summed = norms / grad_scale, {k: v / grad_scale for k, v in summed.items()}
        except EXPLAINED as err:
            raise_explained(_CALL, err)
        if self.nonfinite == "raise":
            released_rows(norms, mask, self.nonfinite, _CALL)
        # a param wider than the dtype it is used in (float64 cast to float32 by the model) gets its sum in its own
        # dtype, as vmap and two_pass give it (found by review: ghost's float32 sum met a float64 zero sum of a rank
        # without rows in the reduce-scatter, and correlated noise refused the float64 buffer)
        wider = {k: torch.promote_types(v.dtype, params[k].dtype) for k, v in summed.items() if k in params and params[k].is_floating_point()}
        summed = {k: v.to(wider[k]) if k in wider and v.dtype != wider[k] else v for k, v in summed.items()}
        return summed, norms, losses

    @property
    def _ghost_form(self) -> tuple[float, Callable[..., Tensor]]:
        """``(grad_scale, loss)`` ghost runs: an fp16 loss with a static loss_scale
        (vmapdp.mixed_precision) offers the form whose params reach the layers as casts, with
        gradients grad_scale times the loss's; ghost divides the (power-of-two) scale out exactly."""
        from vmapdp.precision import scaled_form

        return scaled_form(self.loss_fn) or (1.0, self.loss_fn)

"""Data-parallel DP-SGD on ``torch.distributed``: the collectives and the sharded Poisson sampler.

One logical DP-SGD step on ``W`` ranks (``make_train_step(..., distributed=True)``)::

    every rank:  the same global Poisson sample (indices, mask)    # same sampler key on all ranks
                 its own disjoint share of it                       # shard(): sampled row j -> rank j % W
    all ranks:   check that they step the same state (seed, step)   # check_step(): one tiny all_reduce (a rank's
                                                                    # own input error is raised on all there)
    every rank:  clipped sum + telemetry over its rows              # the usual chunk loop
    all ranks:   one all_reduce(SUM) of the sums and telemetry      # all_reduce_step()
                 the same noise, drawn once from (noise_seed, step) # identical key on every rank
                 ÷ the GLOBAL expected batch size, optimizer update # identical params on every rank

The privacy accounting is unchanged: the global batch is still ONE Poisson sample at rate ``q``
(each example in independently with probability ``q``) and the noise is added once to its
clipped sum, exactly what the ledger records. That is why the ranks must not sample on their
own: ``W`` independent Poisson samples of the whole dataset would put an example in the batch
more than once (its sensitivity is then ``W * C``, not ``C``), and per-rank fixed-size batches
are sampling without replacement, which the Poisson accountant does not cover. Splitting the
dataset into ``W`` parts that each rank Poisson-samples would be a valid Poisson sample too, but
its shapes and load depend on the split; dealing out one global sample keeps every rank's share
within one row of the others.

With ``secure=True`` the noise comes from each process's OS CSPRNG and differs per rank, so rank
0 draws it and broadcasts the noisy sum (:func:`privatized_on_rank0`). A ``secure`` sampler
likewise draws on rank 0 and broadcasts the global batch (:func:`sharded`).

Checkpoints: every rank holds the same state, so rank 0 alone saves it and every rank loads it::

    if vmapdp.distributed.rank() == 0:
        vmapdp.save_state(path, state, sampler=sampler)
    torch.distributed.barrier()          # the file is complete before anyone reads it
    state = vmapdp.load_state(path, sampler=sampler, map_location=device)   # (secure sampler or noise: saved_after_last_step=True, see load_state)

``rank()`` and ``world_size()`` are 0 and 1 when no process group is initialized, so the same
script runs in one process too. End every rank's run with :func:`shutdown`.
"""

from __future__ import annotations

import gc
import hashlib
import math
from typing import Any, Callable, Iterator

import optree
import torch
import torch.distributed as dist
from torch import Tensor

from vmapdp._tree import tensor_bytes
from vmapdp.noise import Privatizer

__all__ = [
    "is_initialized",
    "require_initialized",
    "rank",
    "world_size",
    "all_reduce_sum",
    "all_reduce_step",
    "broadcast_tree",
    "privatized_on_rank0",
    "check_same",
    "check_step",
    "local_capacity",
    "shard",
    "sharded",
    "shutdown",
]

_FIX = (
    "Call torch.distributed.init_process_group(backend) first, in every process (backend 'gloo' for "
    "CPU tensors, 'nccl' for CUDA ones; launch the processes with torchrun, which sets RANK, "
    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
)


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is built into this torch and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def require_initialized(call: str) -> None:
    """Raise a RuntimeError naming the fix unless a default process group is initialized."""
    if not dist.is_available():
        raise RuntimeError(
            f"{call}: distributed=True needs torch.distributed, which this torch build does not have "
            "(torch.distributed.is_available() is False). Install a torch build with distributed support, "
            "or pass distributed=False."
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"{call}: distributed=True needs an initialized torch.distributed process group, and there is none. "
            f"{_FIX}; then build the step. For one process, pass distributed=False."
        )


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return _rank()


def _rank() -> int:  # callable where a ``rank=`` argument shadows ``rank``
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """The number of processes in the default group (1 without one)."""
    return dist.get_world_size() if is_initialized() else 1


def _comm_device() -> torch.device:
    """Where small host-side tensors go for a collective: CUDA for NCCL, the CPU otherwise."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _groups(leaves: list[Tensor]) -> dict[tuple, list[int]]:
    """Leaf positions grouped so that each group travels as ONE flat buffer.

    Floating leaves on one device share a buffer in their widest dtype (float32 sums travel as
    float32; a float64 leaf beside them makes the buffer float64, which sums the float32 values
    more precisely and rounds them back once, identically on every rank). Other dtypes (ints)
    travel in their own buffer.
    """
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            raise TypeError(f"vmapdp.distributed: every leaf must be a tensor, got {type(leaf).__name__}.")
        kind = "float" if leaf.is_floating_point() else leaf.dtype
        groups.setdefault((leaf.device, kind), []).append(i)
    return groups


def _flat_collective(tree: Any, collective) -> Any:
    """``tree`` with every leaf replaced by ``collective(flat buffer)`` of its group; inputs untouched."""
    leaves, spec = optree.tree_flatten(tree, namespace="torch")
    out: list[Tensor | None] = [None] * len(leaves)
    for (_device, _), idx in _groups(leaves).items():
        dtype = leaves[idx[0]].dtype
        for i in idx[1:]:
            dtype = torch.promote_types(dtype, leaves[i].dtype)
        flat = torch.cat([leaves[i].detach().reshape(-1).to(dtype) for i in idx])
        collective(flat)
        for i, part in zip(idx, torch.split(flat, [leaves[i].numel() for i in idx])):
            out[i] = part.reshape(leaves[i].shape).to(leaves[i].dtype)
    return optree.tree_unflatten(spec, out)


def all_reduce_sum(tree: Any) -> Any:
    """The element-wise sum of ``tree`` over all ranks, on every rank (a new tree; ``tree`` is untouched).

    All leaves travel in ONE ``all_reduce`` (a flat concatenation) per device and dtype family, not
    one per leaf. Every rank gets the same bits. Without a process group, a copy of ``tree``.
    """
    if not is_initialized():
        return optree.tree_map(torch.clone, tree, namespace="torch")
    return _flat_collective(tree, lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM))


def broadcast_tree(tree: Any, src: int = 0) -> Any:
    """Rank ``src``'s values of ``tree`` on every rank (a new tree; ``tree`` is untouched).

    Every rank passes a tree of the same structure, shapes and dtypes (the other ranks' values are
    ignored). One ``broadcast`` per device and dtype family.
    """
    if not is_initialized():
        return optree.tree_map(torch.clone, tree, namespace="torch")
    return _flat_collective(tree, lambda flat: dist.broadcast(flat, src=src))


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank (``value`` itself without a process group)."""
    if not is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.broadcast(t, src=src)
    return int(t.item())


def rank0_choice(call: str, pick: Callable[[], int]) -> int:
    """Rank 0's ``pick()`` (an int >= 0) on every rank, in one ``all_reduce``; where ``pick`` raised
    on any rank, every rank raises: that rank its own error, the others a RuntimeError saying so
    (a rank that raised alone would leave the others waiting in their next collective until the
    group's timeout). Every rank calls it at the same point. ``pick()`` itself without a process group."""
    if not is_initialized():
        return pick()
    try:
        value, failed = int(pick()), None
    except Exception as err:
        value, failed = -1, err
    some_failed, chosen = max_ints([int(failed is not None), value if rank() == 0 else -1])
    if failed is not None:
        raise failed
    if some_failed:
        raise RuntimeError(f"{call}: another rank failed while choosing what to run (its error is raised there); this rank stopped with it: nothing was released on any rank.")
    return chosen


def max_ints(values: list[int]) -> list[int]:
    """The element-wise largest of ``values`` over all ranks (one ``all_reduce``; ``values`` itself
    without a process group). Every rank passes a list of the same length."""
    if not is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def _digest(value: Any) -> int:
    """A 62-bit digest of ``repr(value)`` (secret values stay in the process: only the digest travels)."""
    return int.from_bytes(hashlib.sha256(b"vmapdp-check-same:" + repr(value).encode()).digest()[:8], "little") >> 2


def check_same(
    call: str,
    what: str,
    value: Any,
    *,
    fix: str,
    device: torch.device | str | None = None,
    error: BaseException | None = None,
    elsewhere: str | None = None,
) -> None:
    """Raise on EVERY rank (none is left waiting in a collective) unless all ranks hold the same ``value``.

    One tiny ``all_reduce(MAX)`` of ``[digest, -digest, failed]``: every rank sees the largest and
    the smallest digest, and they agree iff all ranks do. ``error``: an exception this rank hit on
    its own before the collective (a bad argument, a refusal only it checks); then every rank
    raises instead of the others waiting in their next collective until the process group's
    timeout: this rank ``error``, the others a RuntimeError (``elsewhere``, default: another rank
    failed before this collective, nothing was released); a rank with ``error`` raises it also when
    the collective itself fails (a peer gone, the timeout). Without a process group: ``error`` is
    raised, else nothing happens.
    """
    if not is_initialized():
        if error is not None:
            raise error
        return
    d = 0 if error is not None else _digest(value)
    t = torch.tensor([d, -d, int(error is not None)], dtype=torch.int64, device=device if device is not None else _comm_device())
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    except Exception as failure:
        if error is not None:
            raise error from failure  # this rank's own failure, not the collective's (a peer gone, the timeout)
        raise
    if int(t[2]):
        if error is not None:
            raise error
        raise RuntimeError(elsewhere or f"{call}: another rank failed before the ranks' check of {what} (its error is raised there); nothing was released.")
    if int(t[0]) != -int(t[1]):
        raise ValueError(f"{call}: the ranks disagree on {what} (this is rank {rank()} of {world_size()}). {fix}")


def state_summary(tree: Any) -> list[tuple[str, Any]]:
    """What the same-state check binds of a replicated pytree of tensors (a data-parallel step's
    noise state): small leaves by value, larger ones by shape, dtype and float64 sum (a buffer of
    correlated noise, ``rows x params``, would cost a copy to the host per step whole)."""
    from vmapdp._tree import path_str

    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace="torch")
    big = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and x.numel() > 16]
    sums = dict(zip(big, torch.stack([leaves[i].detach().sum(dtype=torch.float64).cpu() for i in big]).tolist() if big else []))
    return [
        (path_str(p), (tuple(x.shape), str(x.dtype), sums[i]) if i in sums else x.tolist() if isinstance(x, Tensor) else x)
        for i, (p, x) in enumerate(zip(paths, leaves))
    ]


def check_step(call: str, noise_key: Any, *, error: BaseException | None = None) -> None:
    """The train step's check (one tiny collective, before any other of the step) that every rank
    steps the same state, identified by ``noise_key = (noise_seed, step, ...)`` (the step passes the
    noise binding, the ledger, the clip norm and :func:`state_summary` of the noise state too): ranks
    with different seeds would draw
    different noise and their params would drift apart silently, ranks with different ledgers would
    report different budgets for one release. ``error``: what this rank's own checks of its inputs
    raised (see :func:`check_same`)."""
    check_same(
        call,
        "the state's noise seed and step (and its run, ledger, clip norm and noise state, and whether this process released the step before; a keyed sampler's stream_id; under method='auto', the batch's shapes and the state's recorded choices)",
        noise_key,
        fix="Every rank must step the same TrainState: init_train_state(params, optimizer, seed=S) with the same "
        "seed S and params on every rank (seed=None draws a different seed in each process), or load_state the "
        "same checkpoint on every rank. Under method='auto' (which chooses once per batch shape, on every rank together), step "
        "batches of the same shapes on every rank: vmapdp.distributed.sharded(sampler) pads each rank's share to one capacity.",
        error=error,
    )


def all_reduce_step(call: str, summed: Any, stats: Any, noise_key: Any, *, checked: bool = False) -> tuple[Any, Any]:
    """The train step's reduction: the clipped sums and the telemetry (a pytree of tensors, the
    step's ``StepStats``), summed leaf-wise over ranks.

    First :func:`check_step` (unless ``checked``: the caller ran it), then ONE ``all_reduce`` of
    ``(summed, stats)``.
    """
    if not checked:
        check_step(call, noise_key)
    return all_reduce_sum((summed, stats))


def privatized_on_rank0(privatizer: Privatizer) -> Privatizer:
    """``privatizer`` run by rank 0 alone, its release and next state broadcast to every rank.

    For noise that differs per process (``secure=True``: each OS CSPRNG is its own), so that every
    rank applies the same noisy sum. One ``broadcast`` (per device and dtype family) of
    ``(noisy, state)``; the other ranks pass their own ``(summed, state)`` as placeholders of the
    same structure. Without a process group, ``privatizer`` as it is (copies of its outputs).
    """

    def privatize(summed: Any, state: Any, key: bytes | None) -> tuple[Any, Any]:
        out = privatizer.privatize(summed, state, key) if rank() == 0 else (summed, state)
        return broadcast_tree(out, src=0)

    return privatizer._replace(privatize=privatize, bind=None)  # (its config and period kept)


def local_capacity(capacity: int, world_size: int | None = None) -> int:
    """Each rank's fixed physical batch size for a global ``capacity``: ``ceil(capacity / world_size)``.

    Pass it to ``make_train_step(physical_batch_size=...)`` on every rank.
    """
    w = _world(world_size, "local_capacity")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"local_capacity: capacity={capacity!r} must be an int >= 1 (the sampler's capacity).")
    return math.ceil(capacity / w)


def _world(w: int | None, call: str) -> int:
    if w is None:
        return world_size()
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"{call}: world_size={w!r} must be an int >= 1.")
    return w


def _this_process(call: str, rank: Any, world_size: Any, *, agree: bool = False) -> tuple[int, int]:
    """``(world_size, rank)`` of a share: the default group's where they are None; given ones must
    be a valid pair, and, with a process group of more than one process, this process's (found by
    review: every rank passing rank=0, a local rank where the global one was meant, stepped the
    same half of each batch twice and dropped the other half, and the rows' total still matched).
    ``agree``: every rank calls this (``sharded``), and all refuse together (one ``all_reduce``)."""
    w = _world(world_size, call)
    r = _rank() if rank is None else rank
    valid = not isinstance(r, bool) and isinstance(r, int) and 0 <= r < w
    grouped = is_initialized() and dist.get_world_size() > 1
    mine = not valid or (grouped and (r, w) != (dist.get_rank(), dist.get_world_size()))
    # (agreed by every rank, one all_reduce: a rank refusing alone would leave the others waiting in the step)
    if agree and grouped and max_ints([int(mine)])[0] and not mine:
        raise ValueError(f"{call}: another rank was given a rank= or world_size= that is not its own (its error is raised there); nothing was dealt.")
    if not valid:
        raise ValueError(f"{call}: rank={r!r} must be an int in [0, {w}) (world_size={w}).")
    if mine:
        raise ValueError(
            f"{call}: rank={r}, world_size={w} given, but this process is rank {dist.get_rank()} of {dist.get_world_size()} in "
            "the process group: shares dealt to other ranks' numbers put an example on two ranks (each adding up to C to a sum "
            "charged as C) and drop others. Leave rank= and world_size= out (the group's global rank, not a node-local one)."
        )
    return w, r


def shard(indices: Tensor, mask: Tensor, capacity: int, *, rank: int | None = None, world_size: int | None = None) -> tuple[Tensor, Tensor]:
    """This rank's disjoint share of ONE global Poisson batch ``(indices, mask)``.

    The ``j``-th sampled example of the global batch (the ``j``-th True of ``mask``) goes to rank
    ``j % world_size``: every sampled example is processed by exactly one rank, none is dropped or
    duplicated, and the ranks' shares differ by at most one row. The share is padded (index 0,
    mask False) to a multiple of ``local_capacity(capacity, world_size)``; a share larger than
    that spans several chunks (never truncated), as an overflowing step of the sampler does.

    Every rank must pass the SAME global batch: build the same ``PoissonSampler`` (same
    ``key=``) on every rank, or use :func:`sharded`, which checks that and handles ``secure``
    samplers. This is not per-rank sampling (see the module docstring for why).

    Args:
        indices, mask: one step of ``PoissonSampler`` (int64 and bool, same 1-D shape).
        capacity: the sampler's ``capacity`` (the global physical batch size).
        rank, world_size: default: this process's, from the default process group (0 and 1
            without one). With a process group of several processes they must be this
            process's (other values are for computing shares without a group).

    Returns:
        ``(indices, mask)`` of length ``m * local_capacity(capacity, world_size)``, ``m >= 1``.
    """
    call = "shard(indices, mask, capacity)"
    w, r = _this_process(call, rank, world_size)
    if not isinstance(indices, Tensor) or not isinstance(mask, Tensor):
        raise TypeError(f"{call}: indices and mask must be tensors (one step of PoissonSampler).")
    if mask.dtype != torch.bool or indices.dim() != 1 or indices.shape != mask.shape:
        raise ValueError(
            f"{call}: expected 1-D indices and a bool mask of the same length (one step of PoissonSampler), "
            f"got indices {tuple(indices.shape)} {indices.dtype} and mask {tuple(mask.shape)} {mask.dtype}."
        )
    c = local_capacity(capacity, w)
    mine = indices[mask][r::w]
    k = mine.numel()
    m = max(1, math.ceil(k / c))
    out_idx = torch.zeros(m * c, dtype=indices.dtype, device=indices.device)
    out_mask = torch.zeros(m * c, dtype=torch.bool, device=mask.device)
    out_idx[:k] = mine
    out_mask[:k] = True
    return out_idx, out_mask


def _sampler_fingerprint(sampler: Any) -> tuple:
    state = sampler.state_dict()
    gen = state.get("generator")
    return (
        type(sampler).__name__,
        sampler.num_samples,
        sampler.sample_rate,
        sampler.steps,
        sampler.capacity,
        sampler.secure,
        None if gen is None else hashlib.sha256(tensor_bytes(gen)).hexdigest(),
        state.get("key"),
        state.get("draws"),
        # (every argument that decides the batches: a CyclicPoissonSampler's cycle was not compared, found by review)
        getattr(sampler, "stream_id", None) if not sampler.secure else None,
    )


def _broadcast_batch(batch: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """Rank 0's ``(indices, mask)`` (whose length varies) on every rank."""
    device = _comm_device()
    n = torch.tensor([0 if batch is None else batch[0].numel()], dtype=torch.int64, device=device)
    dist.broadcast(n, src=0)
    if batch is None:
        indices = torch.zeros(int(n), dtype=torch.int64, device=device)
        mask = torch.zeros(int(n), dtype=torch.bool, device=device)
    else:
        indices, mask = batch[0].to(device), batch[1].to(device)
    dist.broadcast(indices, src=0)
    mask = mask.to(torch.uint8)  # bool broadcasts are not supported by every backend
    dist.broadcast(mask, src=0)
    return indices.cpu(), mask.cpu().bool()


def sharded(sampler: Any, *, rank: int | None = None, world_size: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Iterate ``sampler`` (a :class:`vmapdp.data.PoissonSampler` built alike on every rank) and yield this rank's shards.

    Each step draws the global Poisson batch and yields ``shard(indices, mask, sampler.capacity)``
    for this rank; pass ``physical_batch_size=local_capacity(sampler.capacity)`` to the step.
    With a process group, at the start it checks that every rank's sampler is identical (same
    size, rate, capacity and key or generator state) and raises on every rank otherwise: a sampler
    made without ``key=`` draws a random key per process, which would give the ranks different
    batches. A ``secure=True`` sampler cannot agree across processes, so rank 0 draws each batch
    and broadcasts it.
    """
    call = "sharded(sampler)"
    w, r = _this_process(call, rank, world_size, agree=True)
    collective = is_initialized() and w > 1
    if collective:
        check_same(
            call,
            "the sampler (size, rate, capacity, key or generator state)",
            _sampler_fingerprint(sampler),
            fix="Build the same PoissonSampler on every rank with the same secret key= (a generator seed too, but that one is predictable), "
            "or restore every rank's sampler from the same checkpoint.",
        )
    for _ in range(sampler.steps):
        if collective and sampler.secure:
            batch = _broadcast_batch(sampler.sample() if dist.get_rank() == 0 else None)
            if dist.get_rank() != 0 and hasattr(sampler, "_follow_draw"):  # (an epoch sampler: its position names the event)
                sampler._follow_draw()
        else:
            batch = sampler.sample()
        yield shard(*batch, sampler.capacity, rank=r, world_size=w)


def shutdown() -> None:
    """End a distributed run: destroy the process group, then free what still holds it.

    Call it last on every rank instead of ``torch.distributed.destroy_process_group()`` alone. With
    torch 2.13 and gloo, a process that has run ``torch.func`` transforms can keep the process
    group's finished collectives alive in reference cycles; the interpreter then frees them while
    it shuts down, and gloo's worker thread, asking for the GIL to release their tensors, aborts
    the process ("terminate called without an active exception", SIGABRT) after the run has
    finished: about one exit in 15 on a 2-core CPU. Collecting the garbage while the interpreter
    is alive frees them safely (0 aborts in 120 runs).
    """
    if is_initialized():
        dist.destroy_process_group()
    gc.collect()

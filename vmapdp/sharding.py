"""DP-SGD on sharded parameters: each rank keeps 1/W of every parameter and of the optimizer state.

``make_train_step(..., sharding=Sharding(params))`` and ``init_train_state(..., sharding=)``
run the data-parallel step of :mod:`vmapdp.distributed` with the persistent state sharded
(ZeRO-3 / FSDP-style). One logical step on ``W`` ranks::

    every rank:  check that all ranks step the same state      # seed, step, run, config and ledger
                 full = gather(own shards)                   # all_gather, transient (one per dtype)
                 clipped sum + telemetry over its own rows     # the usual chunk loop, on `full`
    all ranks:   own sum = reduce_scatter(clipped sums)        # each owner gets the global sum of its shard
                 own sum + the noise of its shard only         # keyed by the global element index
                 ÷ the GLOBAL expected batch size, optimizer update of its shard

The layout: every parameter is flattened and split like ``torch.chunk`` (FSDP2's ``Shard(0)``
on the flattened tensor): rank ``r`` owns elements ``[r c, min((r + 1) c, n))`` with ``c =
ceil(n / W)``; a rank past the end owns an empty shard. ``state.params`` and the optimizer
state then hold these 1-D local shards (plain tensors).

Equal to one process: the noise of a shard is the slice of the single-process noise (the same
step key, the leaf's index in the flattened params tree as its stream, the shard's global start
as the element offset: :func:`vmapdp.noise.keyed_normal` regenerates any element range bit for
bit), the sum over ranks is a sum (only its order differs), and the optimizers of
:mod:`vmapdp.optim` are element-wise, so updating a shard is the slice of the full update (a
``from_torch`` optimizer not known to be element-wise, Adafactor say, is refused:
``Optimizer.elementwise``). The
run id is that of the full initial params, so the noise keys, the ledger and epsilon are those of
the unsharded run. Correlated noise (:func:`vmapdp.mf.correlated_noise`) is bound with the same
offsets: each owner keeps the streaming buffers of its shards only and runs the element-wise
recursion on them, so its noise and buffers are the slices of the unsharded ones. Adaptive
clipping's count of unclipped samples is summed over ranks with the telemetry and noised once
under the step's key (with ``secure``, by rank 0), so every rank gets the same next clip norm.

Memory: the parameters, the optimizer state and the noise are 1/W per rank (up to one element
per parameter of padding). With ``unshard="step"`` the compute is not: the step gathers the whole
model before the forward and holds the full clipped sums of a chunk until their reduce-scatter,
so the transient peak is that of the unsharded step plus one copy of the params. With
``unshard="use"`` each parameter is gathered only while an op uses it (``_GatheredOnUse``) and
each parameter's clipped sum is reduce-scattered as soon as it is formed (the ``sink`` of
:class:`vmapdp.ClippedGradSum`), so the step's transient shrinks with W too, but for what one
parameter needs while in use (measured in benchmarks/fsdp.py; see the README).

A model already under ``torch.distributed.fsdp.fully_shard`` (FSDP2): :func:`vmapdp.functionalize`
reads it (its parameters are ``DTensor`` s): ``apply`` runs the module's forward without FSDP2's
hooks (no collective inside ``vmap``), and ``params`` are the module's trainable ``DTensor`` s
themselves, not gathered. FSDP2 shards each parameter on dim 0 (``torch.chunk`` of the rows,
padded), vmapdp on the flattened parameter; the two layouts differ (``Linear(5, 9).weight`` on 2
ranks: FSDP2 rows 0-4 | 5-8, i.e. elements 0-24 | 25-44; vmapdp elements 0-22 | 23-44), so the
conversion is explicit and one parameter at a time: ``Sharding(params)`` reads the shapes,
``init_train_state(params, ..., sharding=)`` gathers each parameter in turn (``full_value``, a
collective: every rank calls it) for the run id and keeps its flat shard, and
:meth:`Sharding.write_to_module` writes a state's shards back into the module's FSDP2 shards
(each parameter gathered, then each rank copies its rows), after which the module's own forward
is the trained model. The module keeps its FSDP2 shards while vmapdp trains its own (1/W each).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Any, Iterator, Mapping

import optree
import torch
import torch.distributed as dist
from torch import Tensor, nn

from vmapdp import distributed as _dist
from vmapdp._tree import leaves as _leaves

__all__ = ["Sharding", "local_bytes", "UNSHARD"]

UNSHARD = ("step", "use")


class Sharding:
    """The flat ``Shard(0)`` layout of a params dict over the ranks of the default process group.

    Args:
        params: the full params dict (from :func:`vmapdp.functionalize`), or any dict of tensors
            with the same names, shapes and dtypes (``device="meta"`` tensors work: only shapes
            and dtypes are read).
        rank, world_size: default: this process's, from the default process group (0 and 1
            without one; then every shard is the whole parameter).
        unshard: when the step gathers a parameter's full value from the shards.

            * ``"step"`` (default): the whole model once per step, before the forward (one
              ``all_gather`` per dtype); the full params live until the clipped sums are formed.
              Works with every method and with ``compile=True``.
            * ``"use"``: each parameter where an op uses it, in the forward and again in the
              backward (one ``all_gather`` of that parameter per use), freed when the op returns:
              autograd saves the shard, not the full value, so the full params are never all in
              memory at once (the largest one, and what the op itself holds, is). For models
              bigger than one device. Eager only (``compile=False``) and a named method
              (``"ghost"``, ``"vmap"`` or ``"two_pass"``): ``"auto"``'s race times each rank's
              calls for as long as its clock says, and every rank must make the same gathers.

    Attributes:
        names: the parameter names, in the order of ``params`` (every dict this class returns
            keeps it, so a dict of shards flattens like the full params dict, and each leaf gets
            the same noise stream).
        shapes, dtypes, numels: per name.
    """

    def __init__(self, params: Mapping[str, Tensor], *, rank: int | None = None, world_size: int | None = None, unshard: str = "step") -> None:
        call = "Sharding(params)"
        from vmapdp import _checks

        _checks.params_dict(call, params, fsdp_ok=True)
        self.unshard = _checks.choice(call, "unshard", unshard, UNSHARD, why="when the step gathers a parameter's full value")
        self.world_size = _dist.world_size() if world_size is None else _checks.positive_int(call, "world_size", world_size)
        self.rank = _dist.rank() if rank is None else rank
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"{call}: rank={self.rank!r} must be an int in [0, {self.world_size}) (world_size={self.world_size}).")
        self.names: tuple[str, ...] = tuple(params)
        self.shapes = {k: tuple(params[k].shape) for k in self.names}
        self.dtypes = {k: params[k].dtype for k in self.names}
        self.numels = {k: math.prod(self.shapes[k]) for k in self.names}
        self._told = False  # inside failures_told(): each collective of a step's chunks first asks whether a rank failed

    def __repr__(self) -> str:
        return f"Sharding({len(self.names)} params, {sum(self.numels.values())} elements, rank {self.rank} of {self.world_size}, unshard={self.unshard!r})"

    def chunk(self, name: str) -> int:
        """Elements per shard of ``name`` (``ceil(numel / world_size)``; the last ones may hold fewer)."""
        return -(-self.numels[name] // self.world_size)

    def bounds(self, name: str, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the elements of the flattened ``name`` that ``rank`` (default: this one) owns."""
        r = self.rank if rank is None else rank
        c, n = self.chunk(name), self.numels[name]
        return min(r * c, n), min((r + 1) * c, n)

    @property
    def offsets(self) -> dict[str, int]:
        """This rank's first element of every parameter (``add_noise(offsets=)``)."""
        return {k: self.bounds(k)[0] for k in self.names}

    def local_shape(self, name: str) -> tuple[int]:
        start, stop = self.bounds(name)
        return (stop - start,)

    def check_full(self, call: str, params: Any, what: str = "params") -> None:
        """ValueError unless ``params`` has exactly this layout's names, shapes and dtypes."""
        if not isinstance(params, Mapping) or set(params) != set(self.names):
            got = sorted(params) if isinstance(params, Mapping) else type(params).__name__
            raise ValueError(f"{call}: {what} do not fit the sharding: expected the names {sorted(self.names)}, got {got}. Build the Sharding from these params.")
        for k in self.names:
            if tuple(params[k].shape) != self.shapes[k] or params[k].dtype != self.dtypes[k]:
                raise ValueError(
                    f"{call}: {what}[{k!r}] is {tuple(params[k].shape)} {params[k].dtype}, the sharding expects "
                    f"{self.shapes[k]} {self.dtypes[k]}. Build the Sharding from these params."
                )

    def shard(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's shards of the full ``params`` (1-D copies: nothing is shared with ``params``).
        FSDP2's ``DTensor`` s are gathered one at a time (a collective: every rank calls it)."""
        self.check_full("Sharding.shard(params)", params)
        out = {}
        for k in self.names:
            start, stop = self.bounds(k)
            out[k] = full_value(params[k]).detach().reshape(-1)[start:stop].clone()
        return out

    def check_local(self, call: str, local: Mapping[str, Tensor]) -> None:
        """ValueError unless ``local`` holds this rank's shard of every parameter (1-D, its length)."""
        if not isinstance(local, Mapping) or set(local) != set(self.names):
            raise ValueError(f"{call}: expected this rank's shards of {sorted(self.names)}, got {sorted(local) if isinstance(local, Mapping) else type(local).__name__}.")
        for k in self.names:
            if tuple(local[k].shape) != self.local_shape(k):
                raise ValueError(
                    f"{call}: the shard of {k!r} has shape {tuple(local[k].shape)}, rank {self.rank} of {self.world_size} owns "
                    f"{self.local_shape(k)}: the state was sharded for another world size or layout. Load the checkpoint with "
                    "vmapdp.sharded_checkpoint.load_sharded, which reshards."
                )

    def owner(self, path: tuple, leaf: Any) -> str | None:
        """The parameter whose shard ``leaf`` holds, for a leaf of an optimizer or noise state at
        ``path`` (optree's path): a tensor under a key naming a parameter whose LAST dim is this
        rank's shard length of it (Adam's moments ``[c]``, correlated noise's buffers ``[rows,
        c]``), sharded along that dim. None for a replicated leaf (a step count, a fingerprint)."""
        if not isinstance(leaf, Tensor) or leaf.dim() == 0:
            return None
        name = next((p for p in path if isinstance(p, str) and p in self.shapes), None)
        if name is None or leaf.shape[-1] != self.local_shape(name)[0]:
            return None
        return name

    def replicated(self, tree: Any) -> list[tuple[str, Any]]:
        """``(path, values)`` of the leaves of ``tree`` that every rank holds whole (not
        :meth:`owner`'s shards): what the ranks must agree on (the sharded step checks it)."""
        from vmapdp._tree import path_str

        paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace="torch")
        return [(path_str(p), x.tolist() if isinstance(x, Tensor) else x) for p, x in zip(paths, leaves) if self.owner(p, x) is None]

    def _groups(self, tree: Mapping[str, Tensor]) -> dict[torch.dtype, list[str]]:
        groups: dict[torch.dtype, list[str]] = {}
        for k in self.names:
            groups.setdefault(tree[k].dtype, []).append(k)
        return groups

    def gather(self, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The full params from every rank's shards (one ``all_gather`` per dtype); a new dict."""
        call = "Sharding.gather(shards)"
        self.check_local(call, local)
        if self.world_size == 1 or not _dist.is_initialized():
            return {k: local[k].reshape(self.shapes[k]).clone() for k in self.names}
        out = {}
        for dtype, names in self._groups(local).items():
            device = local[names[0]].device
            width = sum(self.chunk(k) for k in names)
            mine = torch.zeros(width, dtype=dtype, device=device)
            pos = 0
            for k in names:
                n = local[k].numel()
                mine[pos : pos + n] = local[k].detach()
                pos += self.chunk(k)
            every = torch.empty(self.world_size, width, dtype=dtype, device=device)
            dist.all_gather_single(every.view(-1), mine)
            pos = 0
            for k in names:
                c = self.chunk(k)
                out[k] = every[:, pos : pos + c].reshape(-1)[: self.numels[k]].reshape(self.shapes[k])
                pos += c
        return out

    def step_params(self, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The params a step computes with: :meth:`gather` (``unshard="step"``), or tensors of the
        full shapes that gather themselves on each use (``unshard="use"``, see the class)."""
        if self.unshard == "step":
            return self.gather(local)
        self.check_local("Sharding.step_params(shards)", local)
        return {k: _GatheredOnUse(self, k, local[k].detach()) for k in self.names}

    def gather_one(self, name: str, shard: Tensor) -> Tensor:
        """The full value of one parameter from every rank's shard of it (one ``all_gather``)."""
        if self.world_size == 1 or not _dist.is_initialized():
            return shard.reshape(self.shapes[name])
        c = self.chunk(name)
        mine = (shard if shard.numel() == c else torch.cat([shard, shard.new_zeros(c - shard.numel())])).contiguous()
        every = torch.empty(self.world_size * c, dtype=shard.dtype, device=shard.device)
        self._all_fine()  # (last before the collective: a failed allocation above is told, found by review)
        dist.all_gather_single(every, mine)
        return every[: self.numels[name]].view(self.shapes[name])

    def reduce_scatter(self, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's shards of the sum over ranks of ``full`` (one ``reduce_scatter`` per parameter:
        the buffers are one parameter's size)."""
        call = "Sharding.reduce_scatter(sums)"
        if not isinstance(full, Mapping) or set(full) != set(self.names):
            raise ValueError(f"{call}: expected sums of {sorted(self.names)}, got {sorted(full) if isinstance(full, Mapping) else type(full).__name__}.")
        return {k: self.reduce_scatter_one(k, full[k]) for k in self.names}

    def reduce_scatter_one(self, name: str, full: Tensor) -> Tensor:
        """This rank's shard of the sum over ranks of ``full``, a tensor of the shape of ``name``
        (one ``reduce_scatter``; the sharded step's ``sink``, see :class:`vmapdp.ClippedGradSum`)."""
        if tuple(full.shape) != self.shapes[name]:
            raise ValueError(f"Sharding.reduce_scatter_one({name!r}, sum): the sum has shape {tuple(full.shape)}, the parameter {self.shapes[name]}.")
        flat = full.detach().reshape(-1)
        if self.world_size == 1 or not _dist.is_initialized():
            return flat.clone()
        c = self.chunk(name)
        rows = (flat if flat.numel() == self.world_size * c else torch.cat([flat, flat.new_zeros(self.world_size * c - flat.numel())])).contiguous()
        mine = torch.empty(c, dtype=flat.dtype, device=flat.device)
        self._all_fine()  # (last before the collective, as in gather_one)
        dist.reduce_scatter_single(mine, rows, op=dist.ReduceOp.SUM)
        start, stop = self.bounds(name)
        return mine[: stop - start].clone() if stop - start < c else mine

    @contextlib.contextmanager
    def failures_told(self, call: str) -> Iterator[None]:
        """Around a step's chunks with ``unshard="use"``, whose gathers and reduce-scatters run inside
        the forward and backward: a rank whose part raises (its model fails on its rows,
        ``nonfinite="raise"``, memory) tells the others at their next collective instead of leaving
        them waiting in it until the process group's timeout. Before each of them (:meth:`gather_one`,
        :meth:`reduce_scatter_one`) and once at the end, every rank joins one ``all_reduce(MAX)`` of
        whether it failed; a failed rank joins it once with its failure and raises its own error, the
        others raise a RuntimeError there. The ranks make the same collectives in the same order (the
        same-state check and ``_same_chunks`` see to it), so a failure between two of them meets the
        others at the next one, and one after the last meets them at the end. The price: one tiny
        ``all_reduce`` per gather and per reduce-scatter (and, on CUDA, a wait for it on the host)."""
        if self.unshard != "use" or self.world_size == 1 or not _dist.is_initialized():
            yield
            return
        self._told = True
        try:
            yield
        except _PeerFailed:
            raise RuntimeError(
                f"{call}: another rank failed while computing its clipped sums (its error is raised there); this rank "
                "stopped at its next gather or reduce-scatter, before the noise: nothing was released on any rank."
            ) from None
        except BaseException:
            self._told = False
            with contextlib.suppress(Exception):  # (a collective that itself failed, a peer gone: this rank's error is the one to see)
                self._all_fine(failed=True)
            raise
        else:
            try:
                self._all_fine()
            except _PeerFailed:
                raise RuntimeError(
                    f"{call}: another rank failed while computing its clipped sums, after its last gather (its error is raised "
                    "there); this rank stopped with it, before the noise: nothing was released on any rank."
                ) from None
        finally:
            self._told = False

    def _all_fine(self, failed: bool = False) -> None:
        """Inside :meth:`failures_told` (or told ``failed``): one ``all_reduce(MAX)`` of whether a rank
        failed; :class:`_PeerFailed` if another did."""
        if not (self._told or failed):
            return
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=_dist._comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not failed and int(flag.item()):
            raise _PeerFailed()

    def write_to_module(self, module: nn.Module, local: Mapping[str, Tensor]) -> None:
        """Write the params whose shards ``local`` holds (``state.params``) into ``module``: a
        collective (every rank calls it; one gather of the full params, transient). A module under
        ``fully_shard`` gets, on each rank, FSDP2's rows of each parameter copied into its
        ``DTensor``'s local shard (FSDP2's dim-0 layout, not vmapdp's); a plain module gets the
        full values. Afterwards ``module(x)`` runs the trained model. Every check runs before
        anything is written."""
        call = "Sharding.write_to_module(module, shards)"
        self.check_local(call, local)
        from vmapdp import _checks

        targets = _checks.fsdp_module_params(call, module, self.names)
        for k in self.names:  # every shape checked before the first write (and the first gather)
            p = targets[k]
            if tuple(p.shape) != self.shapes[k]:  # (a DTensor's shape is the full one: every rank refuses alike)
                raise RuntimeError(f"{call}: {k!r}: the module's parameter is {tuple(p.shape)}, the sharding's {self.shapes[k]}. Pass the module the params came from.")
            if _is_dtensor(p):  # (FSDP2 changed its layout: refuse rather than scramble)
                dest, rows = p.to_local(), _fsdp_rows(p, torch.empty(self.shapes[k], dtype=self.dtypes[k], device="meta"))
                if tuple(rows.shape) != tuple(dest.shape):
                    raise RuntimeError(f"{call}: {k!r}: the module holds {tuple(dest.shape)} on this rank, its rows of the full parameter are {tuple(rows.shape)}.")
        with torch.no_grad():
            for k in self.names:  # one parameter gathered at a time
                p, full = targets[k], self.gather_one(k, local[k])
                if _is_dtensor(p):
                    p.to_local().copy_(_fsdp_rows(p, full))
                else:
                    p.copy_(full)

    def check_step(self, call: str, same: Any, device: torch.device | None = None, *, error: BaseException | None = None) -> None:
        """A check that every rank steps the same state (``same``: seed, step, noise binding (the
        step's configuration, the method included), ledger, the replicated part of the noise state
        (correlated noise's step count and mechanism), the adaptive clip norm, ``unshard`` and, with
        ``unshard="use"``, the chunking: ``physical_batch_size`` and ``norm_chunk_size``), and the
        order of :attr:`names` (the shards are laid out, gathered and reduce-scattered in it);
        ValueError on every rank otherwise. The sharded step runs it before the first gather:
        ranks that disagree would make different collectives (with ``unshard="use"``, per use).
        ``error``: what this rank's own checks of its inputs raised; every rank then raises (see
        :func:`vmapdp.distributed.check_same`). ``device``: of the collective (None: the backend's)."""
        _dist.check_same(
            call,
            "the state's noise seed, step, run and ledger (and noise state, clip norm, the step's configuration, unshard, whether this process released the step before; "
            "with unshard='use', physical_batch_size and norm_chunk_size; a keyed sampler's stream_id; under method='auto', the batch's shapes and the state's recorded choices; the params' names in their order)",
            (same, self.names),
            fix="Every rank must step the same TrainState: init_train_state(params, optimizer, seed=S, sharding=...) with the "
            "same seed S and params on every rank (seed=None draws a different seed in each process), or load_sharded the "
            "same checkpoint on every rank; build Sharding(params) from params dicts in the same order (functionalize's) on every rank; and make the same train step (method, precision, Sharding(unshard=); with unshard='use' also physical_batch_size and norm_chunk_size) everywhere; under method='auto', step batches of the same shapes on every rank (vmapdp.distributed.sharded(sampler) pads each rank's share to one capacity).",
            device=device,
            error=error,
        )

    def reduce_step(
        self, call: str, summed: Mapping[str, Tensor], stats: Any, same: Any, *, scattered: bool = False, checked: bool = False
    ) -> tuple[dict[str, Tensor], Any]:
        """The sharded step's reduction: first :meth:`check_step` (unless ``checked``: the caller ran
        it), then each rank's shards of the summed clipped sums (reduce-scatter; ``scattered``:
        ``summed`` holds them already, reduce-scattered as they were formed) and the telemetry
        summed over ranks."""
        if not checked:
            self.check_step(call, same, _leaves(stats)[0].device)
        return (dict(summed) if scattered else self.reduce_scatter(summed)), _dist.all_reduce_sum(stats)


class _PeerFailed(Exception):
    """Another rank failed inside the step's chunks (:meth:`Sharding.failures_told`). Not a
    RuntimeError, so that no handler of the methods' own errors (which explain or retry some
    RuntimeErrors) takes it for one of theirs."""


aten = torch.ops.aten
# ops that return a view of their first argument: applied to a gathered-on-use tensor, they
# return another one (the op recorded, applied after each gather), so that nothing autograd
# saves for the backward holds a full parameter
_VIEW_OPS = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
    aten.expand.default, aten.detach.default, aten.alias.default, aten.unsqueeze.default, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.as_strided.default,
    aten.diagonal.default, aten.unfold.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
    aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default, aten.view.dtype, aten.view_as_complex.default, aten.view_as_real.default,
    aten._to_copy.default,  # (a cast: the mixed-precision copies of the params, cast after each gather)
}


class _GatheredOnUse(Tensor):
    """A parameter sharded over the ranks that any op other than a view gathers in full
    (:meth:`Sharding.gather_one`), uses and drops (``Sharding(unshard="use")``). It has the full
    parameter's shape and dtype; it holds only this rank's shard and the view ops applied since."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # (dispatch level only: results are plain tensors)

    @staticmethod
    def __new__(cls, sharding: Sharding, name: str, shard: Tensor, views: tuple = (), like: Tensor | None = None):
        like = torch.empty(sharding.shapes[name], dtype=shard.dtype, device="meta") if like is None else like
        return Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(), dtype=like.dtype, device=shard.device
        )

    def __init__(self, sharding: Sharding, name: str, shard: Tensor, views: tuple = (), like: Tensor | None = None) -> None:
        self.sharding, self.param, self.shard, self.views = sharding, name, shard, views

    def __repr__(self) -> str:
        return f"_GatheredOnUse({self.param!r}, shape={tuple(self.shape)}, rank {self.sharding.rank} of {self.sharding.world_size})"

    def full(self) -> Tensor:
        x = self.sharding.gather_one(self.param, self.shard)
        for func, args, kwargs, index in self.views:
            x = func(x, *args, **kwargs)
            if index is not None:
                x = x[index]
        return x

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        if written is not None:  # (the write would go to a temporary gather: lost, and the op's result unwritten)
            raise RuntimeError(
                f"Sharding(unshard='use'): {func} writes into the parameter {written!r} in place, which is gathered for each "
                "use and dropped, so the write would be lost. Write out of place in the model (w = w.clamp(...) instead of "
                "w.clamp_(...)), or use Sharding(params, unshard='step')."
            )
        if func in _VIEW_OPS and isinstance(args[0], _GatheredOnUse) and not _gathered_in(args[1:], kwargs):
            src = args[0]
            if func is aten._to_copy.default and not _same_device(kwargs.get("device"), src.device):
                pass  # a move to another device: the full value, below
            else:
                shaped = func(torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta"), *args[1:], **kwargs)
                if isinstance(shaped, (list, tuple)):
                    return type(shaped)(cls(src.sharding, src.param, src.shard, src.views + ((func, args[1:], kwargs, i),), t) for i, t in enumerate(shaped))
                return cls(src.sharding, src.param, src.shard, src.views + ((func, args[1:], kwargs, None),), shaped)
        full = lambda t: t.full() if isinstance(t, _GatheredOnUse) else t  # noqa: E731
        return func(*optree.tree_map(full, args, none_is_leaf=True), **optree.tree_map(full, kwargs, none_is_leaf=True))


def _same_device(to: Any, device: torch.device) -> bool:
    """``.to(device=to)`` keeps a tensor on ``device`` (None, or ``"cuda"`` for ``cuda:0`` when that is current)."""
    if to is None:
        return True
    to = torch.device(to)
    if to.type != device.type:
        return False
    if to.index is None and device.type != "cpu":
        module = getattr(torch, device.type, None)
        return module is None or not hasattr(module, "current_device") or module.current_device() == device.index
    return to.index is None or to.index == device.index


def _written(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The parameter of a gathered-on-use tensor that ``func`` writes into (its schema marks the
    argument written), or None."""
    if not func._schema.is_mutable:
        return None
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, _GatheredOnUse):
                    return t.param
    return None


def _gathered_in(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(t, _GatheredOnUse) for t in optree.tree_leaves((args, kwargs), none_is_leaf=True))


def full_value(t: Tensor) -> Tensor:
    """The full value of a parameter: an FSDP2 ``DTensor`` all-gathered (a collective), else ``t``."""
    return t.full_tensor() if _is_dtensor(t) else t


def _is_dtensor(t: Any) -> bool:
    if not dist.is_available():  # a torch built without distributed has no DTensor
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _fsdp_rows(p: Tensor, full: Tensor) -> Tensor:
    """This rank's rows of ``full`` in FSDP2's layout of ``p`` (``Shard(0)`` on a 1-D mesh: the
    rows ``torch.chunk`` gives its mesh rank, empty past the end)."""
    mesh = p.device_mesh
    r, w = mesh.get_local_rank(0), mesh.size(0)
    rows = full.shape[0]
    c = -(-rows // w)
    return full[min(r * c, rows) : min((r + 1) * c, rows)]


RESHARD_FIX = "reshard every fully_shard unit first: for m in module.modules(): if isinstance(m, FSDPModule): m.reshard() (the root's reshard() alone leaves its children unsharded)"


def unsharded_units(module: nn.Module) -> list[str]:
    """The ``fully_shard`` units of ``module`` whose parameters are not sharded now (after a forward
    with ``reshard_after_forward=False``, or ``unshard()``): their parameters are plain full
    tensors. ``[]`` for a plain module (and for parameters ``fully_shard`` was told to ignore)."""
    if not dist.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    out = []
    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [] if group is None else [group]
            if any(not getattr(g, "is_sharded", True) for g in groups):
                out.append(name or "(the root)")
    return out


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``module`` holds ``DTensor`` parameters (``fully_shard``, FSDP2)."""
    return any(_is_dtensor(p) for p in module.parameters())


_FSDP_ATTRS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _fsdp_hook(hook: Any) -> bool:
    fn = getattr(hook, "func", hook)
    return getattr(fn, "__module__", "").startswith("torch.distributed.fsdp")


def plain_twin(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A copy of the module tree of an FSDP2 ``module`` as plain modules: the original classes (not
    ``FSDP<cls>``), FSDP2's forward and backward hooks dropped (other hooks kept), each ``DTensor``
    parameter replaced by a ``meta`` tensor of the full shape (``functional_call`` supplies every
    parameter), buffers shared. Its forward runs no collective, so ``vmap`` can batch it. Used by
    :func:`vmapdp.functionalize`; ``module`` is not changed."""
    from torch.distributed.fsdp import FSDPModule

    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next(b for b in cls.__bases__ if b is not FSDPModule)
    twin = cls.__new__(cls)
    memo[id(module)] = twin
    d = {k: v for k, v in module.__dict__.items() if k not in _FSDP_ATTRS}
    dropped: set[int] = set()
    for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        hooks = OrderedDict(getattr(module, attr))
        for key in [key for key, h in hooks.items() if _fsdp_hook(h)]:
            del hooks[key]
            dropped.add(key)
        d[attr] = hooks
    for attr in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        if attr in d:
            d[attr] = OrderedDict((key, v) for key, v in d[attr].items() if key not in dropped)
    params = {}
    for name, p in module._parameters.items():
        if p is not None and _is_dtensor(p):
            if id(p) not in memo:  # a tied parameter stays tied
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            p = memo[id(p)]
        params[name] = p
    d["_parameters"] = params
    d["_modules"] = {name: None if child is None else plain_twin(child, memo) for name, child in module._modules.items()}
    twin.__dict__.update(d)
    return twin


def local_bytes(tree: Any) -> int:
    """Bytes held by the tensor leaves of ``tree`` (for a sharded state: this rank's share)."""
    return sum(x.numel() * x.element_size() for x in _leaves(tree) if isinstance(x, Tensor))

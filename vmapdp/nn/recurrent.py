"""Recurrent layers that ``torch.func.vmap``, ``torch.func.grad`` and ``torch.compile`` can handle.

``torch.nn.GRU``, ``torch.nn.RNN`` and the ``*Cell`` modules run fused kernels that
``torch.func.vmap`` cannot batch (``vmap(grad(...))`` fails with "output with shape [1, H]
doesn't match the broadcast shape [B, 1, H]"), and ``torch.nn.LSTM`` only runs through a slow
per-sample fallback. The layers here compute the same recurrences as a Python loop over time
steps of plain matrix products, so every function transform sees ordinary tensor ops.

Each class mirrors its torch counterpart: the same constructor arguments, the same parameter
names and shapes (``weight_ih_l0``, ``bias_hh_l1_reverse``, ...; state dicts load both ways),
the same input and output layouts (``batch_first``, unbatched 2-D input, ``h0``/``c0``), and the
same numbers (equal to torch's within float rounding). ``from_torch(module)`` converts a torch
module, copying its parameters; ``vmapdp.fix`` does that for every recurrent layer in a model.

Not supported: ``PackedSequence`` inputs (pad the batch and read each sequence's output at its
last valid step instead). Dropout between layers works in training mode; under ``vmap`` it needs
``randomness="different"`` (one mask per sample) or ``"same"``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

__all__ = ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell"]

_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


# --- one time step of each recurrence (pure functions) --------------------------------------
# `x_proj` is the input projection W_ih x + b_ih, computed for all time steps at once.


def _rnn_step(x_proj: Tensor, h: Tensor, w_hh: Tensor, b_hh: Optional[Tensor], act) -> Tensor:
    return act(x_proj + F.linear(h, w_hh, b_hh))


def _gru_step(x_proj: Tensor, h: Tensor, w_hh: Tensor, b_hh: Optional[Tensor]) -> Tensor:
    x_r, x_z, x_n = x_proj.chunk(3, dim=-1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)
    reset = torch.sigmoid(x_r + h_r)
    update = torch.sigmoid(x_z + h_z)
    new = torch.tanh(x_n + reset * h_n)
    return (1 - update) * new + update * h


def _lstm_step(
    x_proj: Tensor,
    h: Tensor,
    c: Tensor,
    w_hh: Tensor,
    b_hh: Optional[Tensor],
    w_hr: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    gates = x_proj + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    if w_hr is not None:
        h = F.linear(h, w_hr)
    return h, c


def _reject_packed(name: str, input) -> None:
    if isinstance(input, PackedSequence):
        raise TypeError(
            f"vmapdp.nn.{name}: PackedSequence inputs are not supported (torch.func.vmap "
            "cannot batch over variable-length packed data). Pass a padded tensor instead "
            "(torch.nn.utils.rnn.pad_packed_sequence) and read each sequence's output at its "
            "last valid time step."
        )


def _check_init_args(input_size, hidden_size, num_layers, bias, dropout, proj_size) -> None:
    if not isinstance(bias, bool):
        raise TypeError(f"bias should be of type bool, got: {type(bias).__name__}")
    for name, value in (("input_size", input_size), ("hidden_size", hidden_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise ValueError(
            f"dropout should be a number in range [0, 1] (the probability of zeroing an "
            f"element), got {dropout!r}"
        )
    if not isinstance(proj_size, int) or proj_size < 0:
        raise ValueError(f"proj_size should be an int >= 0 (0 disables projections), got {proj_size!r}")
    if proj_size >= hidden_size:
        raise ValueError(f"proj_size has to be smaller than hidden_size, got {proj_size=}, {hidden_size=}")


class _FromTorch:
    """``from_torch`` for the layers and cells below (``cls._torch_class`` is the torch twin)."""

    _torch_class: type

    @classmethod
    def from_torch(cls, module: nn.Module):
        """Converts a ``torch.nn`` recurrent layer of the matching kind.

        Args:
          module: the matching ``torch.nn`` module (``torch.nn.GRU`` for ``GRU.from_torch``).

        Returns:
          A new module with copies of ``module``'s parameters (same names, dtype, device,
          ``requires_grad`` flags) and its training mode; its outputs equal ``module``'s.

        Raises:
          TypeError: if ``module`` is not the matching torch class.
        """
        if not isinstance(module, cls._torch_class):
            raise TypeError(
                f"vmapdp.nn.{cls.__name__}.from_torch: expected a {cls._torch_class.__module__}."
                f"{cls._torch_class.__name__}, got {type(module).__name__}"
            )
        reference = next(module.parameters())
        new = cls(**cls._torch_kwargs(module), device=reference.device, dtype=reference.dtype)
        _copy_parameters(module, new)
        return new


# --- multi-layer recurrent layers --------------------------------------------------------------


class _RecurrentLayer(_FromTorch, nn.Module):
    """Shared machinery of RNN, GRU and LSTM: parameters, layouts, layers and directions."""

    _num_gates: int = 1
    _torch_class: type = nn.RNNBase

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check_init_args(input_size, hidden_size, num_layers, bias, dropout, proj_size)
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        factory = {"device": device, "dtype": dtype}
        num_directions = 2 if bidirectional else 1
        out_size = proj_size if proj_size > 0 else hidden_size
        gate_size = self._num_gates * hidden_size
        self._flat_weights_names: list[str] = []
        # Same registration order and names as torch.nn.RNNBase.
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else out_size * num_directions
            for direction in range(num_directions):
                suffix = f"_l{layer}" + ("_reverse" if direction == 1 else "")
                shapes = [
                    (f"weight_ih{suffix}", (gate_size, layer_input)),
                    (f"weight_hh{suffix}", (gate_size, out_size)),
                ]
                if bias:
                    shapes += [(f"bias_ih{suffix}", (gate_size,)), (f"bias_hh{suffix}", (gate_size,))]
                if proj_size > 0:
                    shapes += [(f"weight_hr{suffix}", (proj_size, hidden_size))]
                for name, shape in shapes:
                    self.register_parameter(name, nn.Parameter(torch.empty(shape, **factory)))
                    self._flat_weights_names.append(name)
        self.reset_parameters()

    # torch-compatible helpers

    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), as torch initializes."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            nn.init.uniform_(weight, -bound, bound)

    def flatten_parameters(self) -> None:
        """No-op, kept so code written for torch.nn recurrent layers keeps working."""

    @property
    def all_weights(self) -> list[list[Tensor]]:
        per_direction = len(self._flat_weights_names) // (self.num_layers * self._num_directions)
        names = self._flat_weights_names
        return [
            [getattr(self, n) for n in names[i : i + per_direction]]
            for i in range(0, len(names), per_direction)
        ]

    @property
    def _num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _out_size(self) -> int:
        return self.proj_size if self.proj_size > 0 else self.hidden_size

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size != 0:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            s += f", nonlinearity={self.nonlinearity!r}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if self.batch_first is not False:
            s += f", batch_first={self.batch_first}"
        if self.dropout != 0:
            s += f", dropout={self.dropout}"
        if self.bidirectional is not False:
            s += f", bidirectional={self.bidirectional}"
        return s

    @classmethod
    def _torch_kwargs(cls, module: nn.Module) -> dict:
        return dict(
            input_size=module.input_size,
            hidden_size=module.hidden_size,
            num_layers=module.num_layers,
            bias=module.bias,
            batch_first=module.batch_first,
            dropout=module.dropout,
            bidirectional=module.bidirectional,
        )

    # forward

    def _initial_state(self, input: Tensor, hx, is_batched: bool, batch_size: int):
        """Returns h0 (and c0) as [num_layers * num_directions, batch, size] tensors."""
        raise NotImplementedError

    def _run_direction(self, x_proj: list[Tensor], state, layer_weights, reverse: bool):
        """Runs one layer in one direction over time; returns (outputs [L, N, out], final state)."""
        raise NotImplementedError

    def forward(self, input: Tensor, hx=None):
        name = type(self).__name__
        _reject_packed(name, input)
        if input.dim() not in (2, 3):
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {input.dim()}D tensor instead")
        if input.size(-1) != self.input_size:
            raise RuntimeError(
                f"input.size(-1) must be equal to input_size. Expected {self.input_size}, got {input.size(-1)}"
            )
        is_batched = input.dim() == 3
        if not is_batched:
            x = input.unsqueeze(1)  # [L, 1, H_in]
        elif self.batch_first:
            x = input.transpose(0, 1)  # [L, N, H_in]
        else:
            x = input
        if x.size(0) == 0:
            raise ValueError(f"{name}: expected a sequence of length >= 1, got input of shape {tuple(input.shape)}")
        states = self._initial_state(input, hx, is_batched, x.size(1))

        finals = []  # per (layer, direction), in torch's h_n order
        for layer in range(self.num_layers):
            if layer > 0 and self.dropout > 0 and self.training:
                x = F.dropout(x, p=self.dropout, training=True)
            outputs = []
            for direction in range(self._num_directions):
                index = layer * self._num_directions + direction
                weights = self._layer_weights(layer, direction)
                x_proj = F.linear(x, weights[0], weights[2]).unbind(0)
                state = tuple(s[index] for s in states)
                out, final = self._run_direction(x_proj, state, weights, reverse=direction == 1)
                outputs.append(out)
                finals.append(final)
            x = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

        final_states = tuple(torch.stack(parts) for parts in zip(*finals))
        if not is_batched:
            x = x.squeeze(1)
            final_states = tuple(s.squeeze(1) for s in final_states)
        elif self.batch_first:
            x = x.transpose(0, 1)
        return x, self._pack_state(final_states)

    def _layer_weights(self, layer: int, direction: int):
        suffix = f"_l{layer}" + ("_reverse" if direction == 1 else "")
        w_ih = getattr(self, f"weight_ih{suffix}")
        w_hh = getattr(self, f"weight_hh{suffix}")
        b_ih = getattr(self, f"bias_ih{suffix}") if self.bias else None
        b_hh = getattr(self, f"bias_hh{suffix}") if self.bias else None
        w_hr = getattr(self, f"weight_hr{suffix}") if self.proj_size > 0 else None
        return w_ih, w_hh, b_ih, b_hh, w_hr

    def _pack_state(self, final_states: tuple[Tensor, ...]):
        return final_states[0]

    def _check_hidden(self, hx: Tensor, is_batched: bool, batch_size: int, size: int, what: str) -> Tensor:
        if is_batched and hx.dim() != 3:
            raise RuntimeError(f"For batched 3-D input, {what} should also be 3-D but got {hx.dim()}-D tensor")
        if not is_batched:
            if hx.dim() != 2:
                raise RuntimeError(f"For unbatched 2-D input, {what} should also be 2-D but got {hx.dim()}-D tensor")
            hx = hx.unsqueeze(1)
        expected = (self.num_layers * self._num_directions, batch_size, size)
        if tuple(hx.shape) != expected:
            raise RuntimeError(f"Expected {what} of size {expected}, got {list(hx.shape)}")
        return hx

    def _zeros(self, input: Tensor, batch_size: int, size: int) -> Tensor:
        shape = (self.num_layers * self._num_directions, batch_size, size)
        return torch.zeros(shape, dtype=input.dtype, device=input.device)


def _copy_parameters(source: nn.Module, target: nn.Module) -> None:
    """Copies parameters by name (values, requires_grad) and the training mode."""
    source_params = dict(source.named_parameters())
    target_params = dict(target.named_parameters())
    if source_params.keys() != target_params.keys():
        raise ValueError(
            f"cannot convert {type(source).__name__} to {type(target).__name__}: parameter names "
            f"differ ({sorted(source_params)} vs {sorted(target_params)})"
        )
    with torch.no_grad():
        for name, param in source_params.items():
            target_params[name].copy_(param)
            target_params[name].requires_grad_(param.requires_grad)
    target.train(source.training)


class RNN(_RecurrentLayer):
    """Elman RNN, ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``; a drop-in for ``torch.nn.RNN``.

    Args:
      input_size, hidden_size, num_layers, nonlinearity ("tanh" | "relu"), bias, batch_first,
      dropout, bidirectional, device, dtype: as ``torch.nn.RNN``.

    Forward: ``rnn(input, h0=None) -> (output, h_n)`` with torch's shapes; ``input`` is
    ``[L, N, H_in]`` (``[N, L, H_in]`` if ``batch_first``) or unbatched ``[L, H_in]``.

    Example:
      >>> rnn = RNN(8, 16, num_layers=2)
      >>> output, h_n = rnn(torch.randn(5, 3, 8))   # [5, 3, 16], [2, 3, 16]
    """

    _num_gates = 1
    _torch_class = nn.RNN

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        if nonlinearity not in _ACTIVATIONS:
            raise ValueError(f"Unknown nonlinearity {nonlinearity!r}. Select from 'tanh' or 'relu'.")
        self.nonlinearity = nonlinearity
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            device=device, dtype=dtype,
        )

    @classmethod
    def _torch_kwargs(cls, module: nn.Module) -> dict:
        return dict(super()._torch_kwargs(module), nonlinearity=module.nonlinearity)

    def _initial_state(self, input, hx, is_batched, batch_size):
        if hx is None:
            return (self._zeros(input, batch_size, self.hidden_size),)
        return (self._check_hidden(hx, is_batched, batch_size, self.hidden_size, "hx"),)

    def _run_direction(self, x_proj, state, weights, reverse):
        _, w_hh, _, b_hh, _ = weights
        act = _ACTIVATIONS[self.nonlinearity]
        (h,) = state
        outputs: list[Optional[Tensor]] = [None] * len(x_proj)
        for t in reversed(range(len(x_proj))) if reverse else range(len(x_proj)):
            h = _rnn_step(x_proj[t], h, w_hh, b_hh, act)
            outputs[t] = h
        return torch.stack(outputs), (h,)


class GRU(_RecurrentLayer):
    """Gated recurrent unit; a drop-in for ``torch.nn.GRU`` (same gates, order r, z, n).

    Args:
      input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device,
      dtype: as ``torch.nn.GRU``.

    Forward: ``gru(input, h0=None) -> (output, h_n)`` with torch's shapes.

    Example:
      >>> gru = GRU(8, 16, batch_first=True)
      >>> output, h_n = gru(torch.randn(3, 5, 8))   # [3, 5, 16], [1, 3, 16]
    """

    _num_gates = 3
    _torch_class = nn.GRU

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            device=device, dtype=dtype,
        )

    _initial_state = RNN._initial_state

    def _run_direction(self, x_proj, state, weights, reverse):
        _, w_hh, _, b_hh, _ = weights
        (h,) = state
        outputs: list[Optional[Tensor]] = [None] * len(x_proj)
        for t in reversed(range(len(x_proj))) if reverse else range(len(x_proj)):
            h = _gru_step(x_proj[t], h, w_hh, b_hh)
            outputs[t] = h
        return torch.stack(outputs), (h,)


class LSTM(_RecurrentLayer):
    """Long short-term memory (gates i, f, g, o; optional projection); a drop-in for ``torch.nn.LSTM``.

    Args:
      input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
      proj_size, device, dtype: as ``torch.nn.LSTM``.

    Forward: ``lstm(input, (h0, c0)=None) -> (output, (h_n, c_n))`` with torch's shapes.

    Example:
      >>> lstm = LSTM(8, 16, bidirectional=True)
      >>> output, (h_n, c_n) = lstm(torch.randn(5, 3, 8))   # [5, 3, 32], [2, 3, 16] x 2
    """

    _num_gates = 4
    _torch_class = nn.LSTM

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            proj_size, device=device, dtype=dtype,
        )

    @classmethod
    def _torch_kwargs(cls, module: nn.Module) -> dict:
        return dict(super()._torch_kwargs(module), proj_size=module.proj_size)

    def _initial_state(self, input, hx, is_batched, batch_size):
        if hx is None:
            return (
                self._zeros(input, batch_size, self._out_size),
                self._zeros(input, batch_size, self.hidden_size),
            )
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"LSTM: expected hx to be a tuple (h0, c0), got {type(hx).__name__}")
        h0, c0 = hx
        if (h0.dim(), c0.dim()) != ((3, 3) if is_batched else (2, 2)):
            which = "batched 3-D" if is_batched else "unbatched 2-D"
            raise RuntimeError(
                f"For {which} input, hx and cx should also be {3 if is_batched else 2}-D but got "
                f"({h0.dim()}-D, {c0.dim()}-D) tensors"
            )
        return (
            self._check_hidden(h0, is_batched, batch_size, self._out_size, "hx"),
            self._check_hidden(c0, is_batched, batch_size, self.hidden_size, "cx"),
        )

    def _run_direction(self, x_proj, state, weights, reverse):
        _, w_hh, _, b_hh, w_hr = weights
        h, c = state
        outputs: list[Optional[Tensor]] = [None] * len(x_proj)
        for t in reversed(range(len(x_proj))) if reverse else range(len(x_proj)):
            h, c = _lstm_step(x_proj[t], h, c, w_hh, b_hh, w_hr)
            outputs[t] = h
        return torch.stack(outputs), (h, c)

    def _pack_state(self, final_states):
        return final_states[0], final_states[1]


# --- single-step cells -------------------------------------------------------------------------


class _Cell(_FromTorch, nn.Module):
    _num_gates: int = 1
    _torch_class: type = nn.RNNCellBase

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        _check_init_args(input_size, hidden_size, 1, bias, 0.0, 0)
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        factory = {"device": device, "dtype": dtype}
        gate_size = self._num_gates * hidden_size
        self.weight_ih = nn.Parameter(torch.empty((gate_size, input_size), **factory))
        self.weight_hh = nn.Parameter(torch.empty((gate_size, hidden_size), **factory))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty(gate_size, **factory))
            self.bias_hh = nn.Parameter(torch.empty(gate_size, **factory))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    reset_parameters = _RecurrentLayer.reset_parameters

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            s += f", nonlinearity={self.nonlinearity!r}"
        return s

    @classmethod
    def _torch_kwargs(cls, module: nn.Module) -> dict:
        return dict(input_size=module.input_size, hidden_size=module.hidden_size, bias=module.bias)

    def _prepare(self, input: Tensor, hx: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor], bool]:
        name = type(self).__name__
        _reject_packed(name, input)
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
        if input.size(-1) != self.input_size:
            raise RuntimeError(
                f"{name}: input has inconsistent input_size: got {input.size(-1)} expected {self.input_size}"
            )
        is_batched = input.dim() == 2
        if hx is not None:
            if hx.dim() != input.dim():
                raise RuntimeError(
                    f"{name}: Expected hidden to be {input.dim()}D like the input, got {hx.dim()}D instead"
                )
            if hx.size(-1) != self.hidden_size:
                raise RuntimeError(
                    f"{name}: hidden has inconsistent hidden_size: got {hx.size(-1)}, expected {self.hidden_size}"
                )
        return input, hx, is_batched

    def _zeros(self, input: Tensor) -> Tensor:
        return torch.zeros(*input.shape[:-1], self.hidden_size, dtype=input.dtype, device=input.device)


class RNNCell(_Cell):
    """One step of an Elman RNN; a drop-in for ``torch.nn.RNNCell`` (input ``[N, H_in]`` or ``[H_in]``)."""

    _num_gates = 1
    _torch_class = nn.RNNCell

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh",
        device=None, dtype=None,
    ) -> None:
        if nonlinearity not in _ACTIVATIONS:
            raise ValueError(f"Unknown nonlinearity {nonlinearity!r}. Select from 'tanh' or 'relu'.")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, bias, device=device, dtype=dtype)

    @classmethod
    def _torch_kwargs(cls, module: nn.Module) -> dict:
        return dict(super()._torch_kwargs(module), nonlinearity=module.nonlinearity)

    def forward(self, input: Tensor, hx: Optional[Tensor] = None) -> Tensor:
        input, hx, _ = self._prepare(input, hx)
        h = self._zeros(input) if hx is None else hx
        x_proj = F.linear(input, self.weight_ih, self.bias_ih)
        return _rnn_step(x_proj, h, self.weight_hh, self.bias_hh, _ACTIVATIONS[self.nonlinearity])


class GRUCell(_Cell):
    """One step of a GRU; a drop-in for ``torch.nn.GRUCell``."""

    _num_gates = 3
    _torch_class = nn.GRUCell

    def forward(self, input: Tensor, hx: Optional[Tensor] = None) -> Tensor:
        input, hx, _ = self._prepare(input, hx)
        h = self._zeros(input) if hx is None else hx
        x_proj = F.linear(input, self.weight_ih, self.bias_ih)
        return _gru_step(x_proj, h, self.weight_hh, self.bias_hh)


class LSTMCell(_Cell):
    """One step of an LSTM; a drop-in for ``torch.nn.LSTMCell`` (``hx`` is ``(h, c)``)."""

    _num_gates = 4
    _torch_class = nn.LSTMCell

    def forward(self, input: Tensor, hx: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
        if hx is None:
            input, _, _ = self._prepare(input, None)
            h = c = self._zeros(input)
        else:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"LSTMCell: expected hx to be a tuple (h, c), got {type(hx).__name__}")
            input, h, _ = self._prepare(input, hx[0])
            _, c, _ = self._prepare(input, hx[1])
        x_proj = F.linear(input, self.weight_ih, self.bias_ih)
        return _lstm_step(x_proj, h, c, self.weight_hh, self.bias_hh, None)


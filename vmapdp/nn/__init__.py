"""Modules that vmap, grad and torch.compile can handle: recurrent layers and low-rank adapters.

:mod:`vmapdp.nn.recurrent`: ``RNN``, ``GRU``, ``LSTM`` and their cells, drop-ins for torch's
recurrent layers (whose fused kernels vmap cannot batch). :mod:`vmapdp.nn.lora`:
``LoRALinear``, ``add_lora`` and ``lora_layers``, adapters (on ``nn.Linear`` and GPT-2-style ``Conv1D``) on a frozen backbone for DP fine-tuning.
"""

from vmapdp.nn.lora import LoRALinear, add_lora, is_conv1d, lora_layers
from vmapdp.nn.recurrent import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNCell

__all__ = ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell", "LoRALinear", "add_lora", "lora_layers", "is_conv1d"]

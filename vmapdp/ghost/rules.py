"""The ops ghost clipping covers, each with its rule: the one table the tracer (plan.py) consults.

A call of one of these ops whose weight is a trainable param becomes a *site*: its input is kept
and a tap added to its output. Any other use of a param goes through a per-sample copy (exact,
slower). To cover a new op, write its ``Rule`` (and ``UseKind`` if its maths are new) in one file
and list it here.
"""

from __future__ import annotations

import torch.nn.functional as F

from vmapdp.ghost.conv import CONV_RULES
from vmapdp.ghost.embedding import EMBEDDING_RULE
from vmapdp.ghost.linear import LINEAR

__all__ = ["RULES"]

RULES = {F.linear: LINEAR, **CONV_RULES, F.embedding: EMBEDDING_RULE}

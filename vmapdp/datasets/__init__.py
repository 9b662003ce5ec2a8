"""Small real datasets that ship with vmapdp, so demos and notebooks run offline.

``load_digits()``: the UCI "Optical Recognition of Handwritten Digits" test set (1,797 images of
8x8 pixels, values 0..16, 10 classes; E. Alpaydin and C. Kaynak, 1998; CC BY 4.0), the same file
scikit-learn ships.

``load_tinyshakespeare()``: Andrej Karpathy's "tiny shakespeare" (1,115,394 characters of
Shakespeare's plays, public domain), the corpus of char-rnn. See ``vmapdp/datasets/README.md``.
"""

from __future__ import annotations

import csv
import gzip
from importlib import resources
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["load_digits", "load_tinyshakespeare", "Split"]


class Split(NamedTuple):
    """A train/test split: images ``[N, 1, 8, 8]`` float32 in [0, 1], labels ``[N]`` int64."""

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor


def _read_digits() -> tuple[Tensor, Tensor]:
    with resources.files("vmapdp.datasets").joinpath("digits.csv.gz").open("rb") as raw:
        with gzip.open(raw, "rt") as text:
            rows = [[int(v) for v in row] for row in csv.reader(text)]
    data = torch.tensor(rows, dtype=torch.int64)
    if data.shape != (1797, 65):
        raise RuntimeError(f"load_digits: the shipped file is damaged (shape {tuple(data.shape)}, expected (1797, 65)); reinstall vmapdp.")
    images = data[:, :64].to(torch.float32).div_(16.0).reshape(-1, 1, 8, 8)
    return images, data[:, 64].clone()


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> Split:
    """The digits dataset, split at random into train and test sets (a fixed split per seed).

    Args:
        test_fraction: the share of the 1,797 examples held out for testing, in (0, 1).
        seed: the seed of the split's permutation.

    Returns:
        A :class:`Split` (images scaled to [0, 1], shape ``[N, 1, 8, 8]``).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"load_digits: test_fraction={test_fraction!r} must be in (0, 1).")
    images, labels = _read_digits()
    perm = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    n_test = round(images.shape[0] * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Split(images[train], labels[train], images[test], labels[test])


def load_tinyshakespeare() -> str:
    """The tiny-shakespeare text (public domain; from karpathy/char-rnn), as one string.

    1,115,394 characters (65 distinct), speeches separated by blank lines, each starting with
    the speaker's name and a colon (``"ROMEO:\\n..."``).
    """
    with resources.files("vmapdp.datasets").joinpath("tinyshakespeare.txt.gz").open("rb") as raw:
        with gzip.open(raw, "rt", encoding="utf-8") as text:
            data = text.read()
    if len(data) != 1115394:
        raise RuntimeError(f"load_tinyshakespeare: the shipped file is damaged ({len(data)} characters, expected 1115394); reinstall vmapdp.")
    return data

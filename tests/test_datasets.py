"""The datasets that ship with vmapdp load offline and are what they claim to be."""

import vmapdp


def test_load_digits_shapes():
    split = vmapdp.datasets.load_digits(seed=0)
    assert split.train_images.shape[1:] == (1, 8, 8)
    assert len(split.train_labels) + len(split.test_labels) == 1797


def test_load_tinyshakespeare():
    text = vmapdp.datasets.load_tinyshakespeare()
    assert len(text) == 1115394 and len(set(text)) == 65
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    assert "ROMEO:\n" in text

"""The main job, `python -m vmapdp demo`, runs offline and DP-SGD learns."""

from __future__ import annotations

import re
import warnings

import pytest

from vmapdp import PublicSeedWarning
from vmapdp.__main__ import main


def test_demo_quick_runs_and_learns(capsys, tmp_path):
    """... and draws its batches and noise from fresh secrets (found by review: with its fixed seeds a
    second process regenerated the noise of a released step and recovered the clipped sum to 1e-5
    while the demo printed epsilon = 3): no PublicSeedWarning is raised."""
    plot = tmp_path / "demo.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error", PublicSeedWarning)
        assert main(["demo", "--quick", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert re.search(r"DP-SGD: 100%\|.*\| (\d+)/\1 ", captured.err)  # the progress bar reached its end
    assert f"plot of epsilon and accuracy over the steps: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert "worst relative error vs float64 oracle" in out
    dp_acc = float(re.search(r"test accuracy, DP-SGD:\s+([0-9.]+)", out).group(1))
    plain_acc = float(re.search(r"test accuracy, non-private:\s+([0-9.]+)", out).group(1))
    eps = float(re.search(r"epsilon = ([0-9.]+)", out).group(1))
    # 10 classes: chance is 0.1; three epochs of DP-SGD on digits reach well above it
    assert dp_acc > 0.5 and plain_acc > 0.7
    assert 0 < eps <= 3.0  # calibrated to the default target, never above it


def test_unknown_command_is_an_error(capsys):
    assert main(["train-everything"]) == 2
    assert "unknown command 'train-everything'" in capsys.readouterr().err


def test_demo_runs_without_compiling_on_a_torch_whose_compiler_cannot(capsys, monkeypatch):
    """On torch older than 2.11 the demo says why and trains eagerly (compile=True is refused there)."""
    import torch

    import vmapdp.__main__ as demo

    class Stop(Exception):
        pass

    seen = []

    def train(*a, compile, **k):
        seen.append(compile)
        raise Stop

    monkeypatch.setattr(torch, "__version__", "2.9.1")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("the demo compiled on torch 2.9"))
    monkeypatch.setattr(demo, "_train", train)
    with pytest.raises(Stop):
        main(["demo", "--epochs", "1", "--plot", ""])
    assert seen == [False] and "compile needs torch>=2.11" in capsys.readouterr().out

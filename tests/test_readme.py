"""The README's Python examples run as written (keeps the README true)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    state = namespace["state"]
    assert state.step == 200 and state.epsilon(1e-5, accountant="pld") <= 3.0  # calibrated by PLD (the default)


def test_readme_commands_match_ci():
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = ci.strip().splitlines()[-1]
    assert test_command in README.read_text(), "the README's test command and .ci/run must be the same"

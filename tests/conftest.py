import os
import sys

# tests import their shared model zoo as a plain module
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_spent_keys():
    """Each test is its own run: many share a seed and a model, which in one process would be two
    runs sharing their noise (vmapdp.noise.spent refuses that; its own tests check it)."""
    from vmapdp.noise.spent import forget_spent_keys

    forget_spent_keys()
    yield

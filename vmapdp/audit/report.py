"""How every privacy self-check ends: :class:`PrivacyCheckError`, raised with the check's report.

Each check builds a frozen report dataclass (``passed``, the figures, ``message``) and hands it to
:func:`finish`, which raises on failure unless the caller asked for the report back.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PrivacyCheckError", "finish"]


class PrivacyCheckError(AssertionError):
    """A privacy self-check failed; ``.report`` holds the figures (a frozen report dataclass)."""

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


def finish(report: Any, raise_on_failure: bool) -> Any:
    if not report.passed and raise_on_failure:
        raise PrivacyCheckError(report.message, report)
    return report

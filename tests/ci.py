"""Tests that need a tool of the machine: skipped where it is missing, failed under CI.

A hardening check that quietly skips on a CI machine without ``systemd-analyze`` or libseccomp
would drop that check unnoticed, so under ``CI=true`` (as with PostgreSQL, tests/conftest.py)
a missing tool fails the test that needs it, naming what to install.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def needs(present: bool, what: str, *, ci: bool | None = None) -> Callable[[F], F]:
    """Decorate a test that needs ``what`` (present on this machine or not)."""

    def decorate(test: F) -> F:
        if present:
            return test
        if not (in_ci() if ci is None else ci):
            return pytest.mark.skip(reason=f"{what} is not installed on this machine")(test)  # type: ignore[no-any-return]

        @functools.wraps(test)
        def fails(*args: Any, **kwargs: Any) -> None:
            pytest.fail(f"{what} is missing and CI=true: install it on the CI machine")

        return fails  # type: ignore[return-value]

    return decorate

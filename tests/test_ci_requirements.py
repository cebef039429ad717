"""A test that needs a missing tool skips on a developer's machine and fails under CI=true."""

from __future__ import annotations

import pytest

from tests.ci import needs


def probe() -> str:
    return "ran"


def test_a_present_tool_leaves_the_test_as_it_is() -> None:
    assert needs(True, "tool", ci=True)(probe) is probe


def test_a_missing_tool_skips_outside_ci() -> None:
    marked = needs(False, "systemd-analyze", ci=False)(probe)
    [mark] = marked.pytestmark  # type: ignore[attr-defined]
    assert mark.name == "skip" and "systemd-analyze" in mark.kwargs["reason"]


def test_a_missing_tool_fails_the_test_under_ci() -> None:
    failing = needs(False, "libseccomp", ci=True)(probe)
    with pytest.raises(pytest.fail.Exception, match="libseccomp is missing and CI=true"):
        failing()
    assert failing.__name__ == "probe"  # pytest still reports it under its own name


def test_ci_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        needs(False, "tool")(probe)()
    monkeypatch.delenv("CI")
    assert needs(False, "tool")(probe).pytestmark[0].name == "skip"  # type: ignore[attr-defined]

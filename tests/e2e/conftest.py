"""A local fleet of real processes serving the reference engine, and the token streams an
uninterrupted run produces, to compare moved sessions against."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec
from tests.fleet_checks import SESSIONS, reference_streams, request

__all__ = ["SESSIONS", "request"]  # the e2e tests import them from here

MODEL = "small"
NODES = (
    NodeSpec("h100-a", "NVIDIA H100 80GB HBM3", 2),
    NodeSpec("h100-b", "NVIDIA H100 80GB HBM3", 2),
    NodeSpec("h200-a", "NVIDIA H200", 2),
)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small-model")
    assert make_model(["--out", str(out), "--preset", "small", "--seed", "3"]) == 0
    return out


@pytest.fixture(scope="session")
def reference_tokens(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, list[int]]]:
    """Per session length, what each session produces when nothing moves it."""
    port_file = tmp_path_factory.mktemp("ref") / "port"
    return reference_streams(model_dir, port_file, MODEL, (400, 700))


def make_fleet(
    root: Path, model_dir: Path, planner: str = "[planner]\ninterval_s = 0\n", **kw: object
) -> LocalFleet:
    return LocalFleet(
        root,
        NODES,
        heartbeat_interval_s=0.3,
        node_lost_after_s=5.0,
        daemon_extra=(
            planner
            + f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\nmodel_dir = "{model_dir}"\n'
            "tp_options = [1]\n"
        ),
        agent_extra="worker_compile = false\nworker_threads = 1\n",
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def fleet(tmp_path: Path, model_dir: Path) -> Iterator[LocalFleet]:
    local = make_fleet(tmp_path / "fleet", model_dir)
    try:
        local.start(timeout_s=120)
        yield local
    finally:
        local.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each test's call report on its item: a fixture shared between tests (the crash
    tests' fleet) is discarded after a test that failed, so the next one starts clean."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]

"""A local fleet of real processes serving the reference engine, and the token streams an
uninterrupted run produces, to compare moved sessions against."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec

MODEL = "small"
NODES = (
    NodeSpec("h100-a", "NVIDIA H100 80GB HBM3", 2),
    NodeSpec("h100-b", "NVIDIA H100 80GB HBM3", 2),
    NodeSpec("h200-a", "NVIDIA H200", 2),
)
# Two greedy and two seeded sessions, long enough to be mid-stream while a move runs.
SESSIONS = [
    ("s-greedy-1", [11, 22, 33, 44], 0.0, None),
    ("s-greedy-2", [5, 6, 7, 8, 9, 10], 0.0, None),
    ("s-seeded-1", [100, 200, 300], 0.9, 1234),
    ("s-seeded-2", [42] * 12, 1.2, 99),
]


def request(
    session: tuple[str, list[int], float, int | None], tokens: int, suffix: str = ""
) -> worker_pb2.GenerateRequest:
    sid, prompt, temperature, seed = session
    sampling = worker_pb2.WorkerSampling(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
        sampling.top_p = 0.9
    return worker_pb2.GenerateRequest(
        prompt_tokens=prompt, max_new_tokens=tokens, sampling=sampling, session_id=sid + suffix
    )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small-model")
    assert make_model(["--out", str(out), "--preset", "small", "--seed", "3"]) == 0
    return out


class ReferenceTokens:
    """Per session length, what each session produces when nothing moves it: computed on
    first use by a worker of its own (a file that needs one length pays for that one only)."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self._model_dir, self._root = model_dir, root
        self._runs: dict[int, dict[str, list[int]]] = {}

    def __getitem__(self, tokens: int) -> dict[str, list[int]]:
        if tokens not in self._runs:  # in a thread: the caller may be a test's event loop
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                self._runs[tokens] = pool.submit(self._run, tokens).result()
        return self._runs[tokens]

    def _run(self, tokens: int) -> dict[str, list[int]]:
        port_file = self._root / f"port-{tokens}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetshift_agent.worker", "--model-dir", str(self._model_dir),
             "--listen", "127.0.0.1:0", "--port-file", str(port_file), "--no-compile",
             "--threads", "1", "--model-id", MODEL],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (port_file.exists() and port_file.read_text().strip()):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            endpoint = f"127.0.0.1:{int(port_file.read_text())}"

            async def run() -> dict[str, list[int]]:
                async with grpc.aio.insecure_channel(endpoint) as ch:
                    stub = worker_pb2_grpc.WorkerServiceStub(ch)

                    async def one(s: tuple[str, list[int], float, int | None]) -> list[int]:
                        return [m.token async for m in stub.Generate(request(s, tokens, "-ref"))]

                    results = await asyncio.gather(*(one(s) for s in SESSIONS))
                return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}

            return asyncio.run(run())
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)  # a loaded machine may take a while to let it exit
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


@pytest.fixture(scope="session")
def reference_tokens(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ReferenceTokens:
    return ReferenceTokens(model_dir, tmp_path_factory.mktemp("ref"))


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

"""The small reference model of tests/e2e, and the token streams an uninterrupted run of its
sessions produces (only at the one length these tests stream)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import worker_pb2_grpc
from tests.e2e.conftest import MODEL, SESSIONS, model_dir, request
from tests.e2e.test_moves import TOKENS

__all__ = ["model_dir", "reference_tokens"]


@pytest.fixture(scope="session")
def reference_tokens(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, list[int]]]:
    port_file = tmp_path_factory.mktemp("ref") / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetshift_agent.worker", "--model-dir", str(model_dir),
         "--listen", "127.0.0.1:0", "--port-file", str(port_file), "--no-compile", "--threads", "1",
         "--model-id", MODEL],
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
                    return [m.token async for m in stub.Generate(request(s, TOKENS, "-ref"))]

                results = await asyncio.gather(*(one(s) for s in SESSIONS))
            return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}

        return {TOKENS: asyncio.run(run())}
    finally:
        proc.kill()  # its output is all in: no need to wait for a graceful stop on a busy host
        proc.wait(timeout=60)

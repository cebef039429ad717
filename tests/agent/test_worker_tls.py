"""A worker process with its node's certificate: who may call what, over real mTLS on loopback.

The worker is started the way the supervisor starts it on a node with TLS (the node's
certificate, key and CA, its node name, the allowed session callers) and then called with
each kind of certificate the fleet's CA issues. Control calls pass for the daemon and the
worker's own node only; sessions for the listed callers only; plaintext not at all. The
namespace test (tests/multihost) repeats the matrix across real network stacks.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_rpc import pki
from fleetshift_rpc.security import client_credentials
from tests.agent.worker_process import serving_worker

pytestmark = pytest.mark.slow
LOOPBACK = {"san_ips": ["127.0.0.1"]}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root)
    pki.issue(root, "node", "node-a", **LOOPBACK)  # type: ignore[arg-type]
    pki.issue(root, "node", "node-b", **LOOPBACK)  # type: ignore[arg-type]
    pki.issue(root, "daemon", "fleetshiftd", **LOOPBACK)  # type: ignore[arg-type]
    pki.issue(root, "router", "edge")
    pki.issue(root, "router", "other-edge")
    pki.issue(root, "operator", "alice")
    return root


def _worker_argv(model: Path, port_file: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "fleetshift_agent.worker", "--model-dir", str(model),
        "--port-file", str(port_file), "--worker-id", "w-tls", "--no-compile", "--threads", "1",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def worker(home: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port_file = tmp_path_factory.mktemp("w") / "port"
    tls = ["--tls-cert", str(home / "node-node-a.crt"), "--tls-key", str(home / "node-node-a.key")]
    argv = _worker_argv(
        tiny_model, port_file, "--listen", "127.0.0.1:0", "--node-name", "node-a",
        *tls, "--tls-ca", str(home / "ca.crt"), "--session-caller", "router:edge",
    )  # fmt: skip
    with serving_worker(argv, port_file, stop_timeout_s=10) as address:
        yield address


def _as(home: Path, kind: str, name: str) -> grpc.ChannelCredentials:
    pair = home / f"{kind}-{name}"
    return client_credentials(str(home / "ca.crt"), cert=f"{pair}.crt", key=f"{pair}.key")


async def _outcome(call: Callable[[], Awaitable[Any]]) -> grpc.StatusCode:
    try:
        await call()
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _calls(channel: grpc.aio.Channel) -> dict[str, grpc.StatusCode]:
    stub = worker_pb2_grpc.WorkerServiceStub(channel)

    async def generate() -> None:
        request = worker_pb2.GenerateRequest(prompt_tokens=[1, 2, 3], max_new_tokens=1)
        async for _ in stub.Generate(request, timeout=30):
            return

    return {
        "cancel": await _outcome(
            lambda: stub.CancelSession(
                worker_pb2.CancelSessionRequest(session_id="nobody"), timeout=10
            )
        ),
        "draining": await _outcome(
            lambda: stub.SetDraining(
                worker_pb2.SetWorkerDrainingRequest(draining=False), timeout=10
            )
        ),
        "generate": await _outcome(generate),
    }


OK, DENIED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
EXPECTED = {
    # (kind, name): (control, session)
    ("daemon", "fleetshiftd"): (OK, DENIED),
    ("node", "node-a"): (OK, DENIED),  # the worker's own agent
    ("node", "node-b"): (DENIED, DENIED),  # another node's agent
    ("router", "edge"): (DENIED, OK),  # listed with --session-caller
    ("router", "other-edge"): (DENIED, DENIED),  # a router the operator did not list
    ("operator", "alice"): (DENIED, DENIED),
}


@pytest.mark.parametrize(("kind", "name"), list(EXPECTED), ids=[f"{k}-{n}" for k, n in EXPECTED])
async def test_worker_takes_control_from_daemon_and_own_agent_only(
    home: Path, worker: str, kind: str, name: str
) -> None:
    control, session = EXPECTED[(kind, name)]
    async with grpc.aio.secure_channel(worker, _as(home, kind, name)) as ch:
        got = await _calls(ch)
    # An allowed CancelSession reaches the worker and finds no such session.
    assert got["cancel"] == (grpc.StatusCode.NOT_FOUND if control is OK else DENIED)
    assert got["draining"] == control
    assert got["generate"] == session


async def test_worker_with_tls_serves_nothing_in_plaintext(worker: str) -> None:
    async with grpc.aio.insecure_channel(worker) as ch:
        got = await _calls(ch)
    assert set(got.values()) == {grpc.StatusCode.UNAVAILABLE}


def test_plaintext_worker_off_loopback_refuses_to_start(tiny_model: Path, tmp_path: Path) -> None:
    """Refused before the engine loads, naming the key, not after minutes of loading."""
    done = subprocess.run(
        _worker_argv(tiny_model, tmp_path / "port", "--listen", "198.18.0.1:0"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "not a loopback address" in done.stderr and "198.18.0.1" in done.stderr
    assert not (tmp_path / "port").exists()


def test_worker_certificate_must_name_its_node(
    home: Path, tiny_model: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        _worker_argv(
            tiny_model, tmp_path / "port", "--listen", "127.0.0.1:0", "--node-name", "node-b",
            "--tls-cert", str(home / "node-node-a.crt"), "--tls-key", str(home / "node-node-a.key"),
            "--tls-ca", str(home / "ca.crt"),
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "identifies node:node-a, expected node:node-b" in done.stderr

"""The real processes with mTLS on: certificates issued by `fleetshift certs`, an agent that
registers over mTLS, an operator who lists and cordons with a certificate, and an
agent certificate that may not act as an operator."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_rpc.security import client_credentials

pytestmark = pytest.mark.slow


def certs(*args: str) -> str:
    cmd = [sys.executable, "-m", "fleetshift_daemon.cli.main", "certs", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        time.sleep(0.05)
    raise TimeoutError(path)


@pytest.fixture
def tls_fleet(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    pki = tmp_path / "pki"
    certs("init-ca", str(pki))
    certs("issue-server", str(pki), "fleetshiftd", "--san-ip", "127.0.0.1")
    certs("issue-node", str(pki), "gpu-node-1", "--san-ip", "127.0.0.1")
    certs("issue-operator", str(pki), "alice")
    certs("new-token", str(pki / "tokens"), "bob")  # a token file must parse at start
    procs: list[subprocess.Popen[bytes]] = []
    try:
        daemon_cfg = tmp_path / "daemon.toml"
        daemon_cfg.write_text(
            'listen = "127.0.0.1:0"\n'
            f'state_dir = "{tmp_path / "d"}"\nport_file = "{tmp_path / "d.port"}"\n'
            f'tls_cert = "{pki / "daemon-fleetshiftd.crt"}"\ntls_key = "{pki / "daemon-fleetshiftd.key"}"\n'
            f'tls_ca = "{pki / "ca.crt"}"\noperator_tokens_file = "{pki / "tokens"}"\n'
            "heartbeat_interval_s = 0.3\nnode_lost_after_s = 3\n"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(daemon_cfg)]
            )
        )
        port = wait_file(tmp_path / "d.port", procs[0])
        agent_cfg = tmp_path / "agent.toml"
        agent_cfg.write_text(
            'node_name = "gpu-node-1"\nlisten = "127.0.0.1:0"\n'
            f'daemon_address = "127.0.0.1:{port}"\nstate_dir = "{tmp_path / "a"}"\n'
            f'port_file = "{tmp_path / "a.port"}"\ninventory = "declared"\n'
            f'tls_cert = "{pki / "node-gpu-node-1.crt"}"\ntls_key = "{pki / "node-gpu-node-1.key"}"\n'
            f'tls_ca = "{pki / "ca.crt"}"\n'
            '[[gpus]]\nproduct_name = "NVIDIA H200"\ncount = 1\n'
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "fleetshift_agent.main", "--config", str(agent_cfg)]
            )
        )
        wait_file(tmp_path / "a.port", procs[1])
        yield pki, port
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def operator_stub(pki: Path, port: int, **creds: str) -> pb_grpc.FleetOperatorStub:
    channel = grpc.secure_channel(
        f"127.0.0.1:{port}", client_credentials(str(pki / "ca.crt"), **creds)
    )
    return pb_grpc.FleetOperatorStub(channel)


def test_mtls_fleet_registers_and_enforces_roles(tls_fleet: tuple[Path, int]) -> None:
    pki, port = tls_fleet
    alice = operator_stub(
        pki, port, cert=str(pki / "operator-alice.crt"), key=str(pki / "operator-alice.key")
    )
    deadline = time.monotonic() + 20
    nodes: list[pb.Node] = []
    while time.monotonic() < deadline and not nodes:
        nodes = list(alice.ListNodes(pb.ListNodesRequest(), timeout=5).nodes)
        time.sleep(0.1)
    assert [n.name for n in nodes] == ["gpu-node-1"]
    assert alice.CordonNode(pb.CordonNodeRequest(node_name="gpu-node-1"), timeout=5).cordoned

    node_cert = operator_stub(
        pki, port, cert=str(pki / "node-gpu-node-1.crt"), key=str(pki / "node-gpu-node-1.key")
    )
    with pytest.raises(grpc.RpcError) as err:
        node_cert.UncordonNode(pb.UncordonNodeRequest(node_name="gpu-node-1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    plaintext = pb_grpc.FleetOperatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    with pytest.raises(grpc.RpcError) as err:
        plaintext.ListNodes(pb.ListNodesRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_node_certificate_cannot_register_as_another_node(tls_fleet: tuple[Path, int]) -> None:
    pki, port = tls_fleet
    creds = client_credentials(
        str(pki / "ca.crt"),
        cert=str(pki / "node-gpu-node-1.crt"),
        key=str(pki / "node-gpu-node-1.key"),
    )
    agents = pb_grpc.AgentRegistryStub(grpc.secure_channel(f"127.0.0.1:{port}", creds))
    request = pb.RegisterNodeRequest(
        node_name="someone-else",
        agent_address="127.0.0.1:1",
        gpus=[pb.Gpu(index=0, product_name="NVIDIA H200", memory_bytes=141 * 1024**3)],
    )
    with pytest.raises(grpc.RpcError) as err:
        agents.RegisterNode(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "someone-else" in err.value.details() and "gpu-node-1" in err.value.details()


def test_node_certificate_cannot_heartbeat_as_another_node(tls_fleet: tuple[Path, int]) -> None:
    """gpu-node-1's agent is registered and heartbeating; another node's certificate, issued
    by the same CA, cannot heartbeat in its name (the running fleetshiftd refuses it)."""
    pki, port = tls_fleet
    certs("issue-node", str(pki), "gpu-node-2", "--san-ip", "127.0.0.1")
    operator = operator_stub(
        pki, port, cert=str(pki / "operator-alice.crt"), key=str(pki / "operator-alice.key")
    )
    deadline = time.monotonic() + 20
    while not operator.ListNodes(pb.ListNodesRequest(), timeout=5).nodes:
        assert time.monotonic() < deadline, "gpu-node-1 never registered"
        time.sleep(0.1)
    creds = client_credentials(
        str(pki / "ca.crt"),
        cert=str(pki / "node-gpu-node-2.crt"),
        key=str(pki / "node-gpu-node-2.key"),
    )
    agents = pb_grpc.AgentRegistryStub(grpc.secure_channel(f"127.0.0.1:{port}", creds))
    with pytest.raises(grpc.RpcError) as err:
        agents.Heartbeat(pb.HeartbeatRequest(node_name="gpu-node-1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "gpu-node-1" in err.value.details() and "gpu-node-2" in err.value.details()

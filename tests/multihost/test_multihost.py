"""A fleet of several hosts on one machine: the daemon, three nodes (agent and workers) and a
client, each in a network namespace of its own on one bridge, all over mTLS from one PKI.

Across those namespaces: the nodes register and heartbeat, Route's answer is an address the
client can dial, a warm move (H100 -> H100: snapshot, agent-to-agent transfer, session KV
copies) and a cold move (H100 -> H200) run while the client streams four sessions, and every
token equals an uninterrupted run. Nothing the nodes or the daemon serve answers plaintext
from another namespace, and a worker refuses control calls from anything but the daemon and
its own agent, and sessions from callers not listed. One fleet serves all checks; the client
is a separate process in its own namespace (``tests/multihost/client.py``).

Needs root and iproute2; skipped without them on a developer machine, failed under CI=true.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_rpc import pki
from tests.ci import needs
from tests.multihost.netns import Host, Lab, netns_supported, remaining

TIME_BOUND_S = 1200.0  # the whole module; every wait below is bounded by what is left of it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIME_BOUND_S)]

SUPPORTED, MISSING = netns_supported()
REPO = Path(__file__).resolve().parents[2]
MODEL = "small"
TOKENS = 300
HEARTBEAT_S = 0.5
DAEMON_PORT, AGENT_PORT = 50051, 50052
# label -> (last octet of its address, declared GPU product)
NODES = {
    "n1": (11, "NVIDIA H100 80GB HBM3"),
    "n2": (12, "NVIDIA H100 80GB HBM3"),
    "n3": (13, "NVIDIA H200"),
}


@dataclass
class Fleet:
    lab: Lab
    root: Path
    daemon: Host
    client: Host
    nodes: dict[str, Host]
    deadline: float

    def spec_file(self) -> Path:
        return self.root / "spec.json"

    def client_run(self, command: str) -> dict[str, Any]:
        """Run a client command in the client's namespace; its JSON answer."""
        argv = [sys.executable, "-m", "tests.multihost.client", str(self.spec_file()), command]
        done = self.lab.run(self.client, argv, timeout_s=remaining(self.deadline), env=_env())
        assert done.returncode == 0, f"client {command} failed:\n{done.stderr[-4000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _issue_pki(root: Path, daemon: Host, nodes: dict[str, Host]) -> Path:
    home = root / "pki"
    pki.init_ca(home)
    pki.issue(home, "daemon", "fleetshiftd", san_ips=[daemon.address])
    for name, host in nodes.items():
        pki.issue(home, "node", name, san_ips=[host.address])
    pki.issue(home, "router", "edge")
    pki.issue(home, "operator", "alice")
    return home


def _tls(home: Path, kind: str, name: str) -> str:
    return (
        f'tls_cert = "{home / f"{kind}-{name}.crt"}"\ntls_key = "{home / f"{kind}-{name}.key"}"\n'
        f'tls_ca = "{home / "ca.crt"}"\n'
    )


def _wait_port_file(path: Path, proc: Any, deadline: float) -> None:
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, f"{path.stem} exited with {proc.returncode}"
        remaining(deadline)
        time.sleep(0.1)


def _start(fleet: Fleet, home: Path, model_dir: Path) -> None:
    root, lab = fleet.root, fleet.lab
    daemon_cfg = root / "daemon.toml"
    daemon_cfg.write_text(
        f'listen = "{fleet.daemon.endpoint(DAEMON_PORT)}"\nstate_dir = "{root / "daemon"}"\n'
        f'port_file = "{root / "daemon.port"}"\n' + _tls(home, "daemon", "fleetshiftd")
        + f"heartbeat_interval_s = {HEARTBEAT_S}\nnode_lost_after_s = 8\n"
        "[planner]\ninterval_s = 0\n"
        f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\nmodel_dir = "{model_dir}"\n'
        "tp_options = [1]\n"
    )  # fmt: skip
    daemon = lab.popen(
        fleet.daemon,
        [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(daemon_cfg)],
        root / "daemon.log",
        _env(),
    )
    _wait_port_file(root / "daemon.port", daemon, fleet.deadline)
    for name, host in fleet.nodes.items():
        cfg = root / f"agent-{name}.toml"
        cfg.write_text(
            f'node_name = "{name}"\nlisten = "{host.endpoint(AGENT_PORT)}"\n'
            f'daemon_address = "{fleet.daemon.endpoint(DAEMON_PORT)}"\n'
            f'state_dir = "{root / name}"\nport_file = "{root / f"{name}.port"}"\n'
            'inventory = "declared"\nworker_compile = false\nworker_threads = 1\n'
            "reconnect_max_s = 1\n" + _tls(home, "node", name)
            + f'[[gpus]]\nproduct_name = "{NODES[name][1]}"\ncount = 2\n'
        )  # fmt: skip
        agent = lab.popen(
            host,
            [sys.executable, "-m", "fleetshift_agent.main", "--config", str(cfg)],
            root / f"agent-{name}.log",
            _env(),
        )
        _wait_port_file(root / f"{name}.port", agent, fleet.deadline)
    fleet.spec_file().write_text(
        json.dumps(
            {
                "pki": str(home),
                "daemon": fleet.daemon.endpoint(DAEMON_PORT),
                "nodes": {n: h.endpoint(AGENT_PORT) for n, h in fleet.nodes.items()},
                "model": MODEL,
                "tokens": TOKENS,
                "heartbeat_interval_s": HEARTBEAT_S,
                "move_path": list(fleet.nodes),
            }
        )
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = time.monotonic()
    root = tmp_path_factory.mktemp("multihost")
    model_dir = root / "model"
    assert make_model(["--out", str(model_dir), "--preset", MODEL, "--seed", "3"]) == 0
    with Lab() as lab:
        daemon = lab.add_host("daemon", 2)
        client = lab.add_host("client", 100)
        nodes = {name: lab.add_host(name, octet) for name, (octet, _) in NODES.items()}
        built = Fleet(lab, root, daemon, client, nodes, started + TIME_BOUND_S)
        _start(built, _issue_pki(root, daemon, nodes), model_dir)
        yield built
    print(f"\nmulti-host fleet: {time.monotonic() - started:.1f} s from namespaces to teardown")


@pytest.fixture(scope="module")
def ready(fleet: Fleet) -> dict[str, Any]:
    return fleet.client_run("ready")


@pytest.fixture(scope="module")
def moved(fleet: Fleet, ready: dict[str, Any]) -> dict[str, Any]:
    assert "timeout" not in ready, ready
    return fleet.client_run("moves")


@needs(SUPPORTED, MISSING)
def test_nodes_register_and_heartbeat_across_namespaces(
    fleet: Fleet, ready: dict[str, Any]
) -> None:
    assert "timeout" not in ready, ready
    assert set(ready["nodes"]) == set(NODES)
    for name, node in ready["nodes"].items():
        assert node["state"] == "NODE_STATE_READY"
        assert node["agent_address"] == fleet.nodes[name].endpoint(AGENT_PORT)
        assert node["heartbeat_advanced"], f"{name}'s heartbeats did not reach the daemon"


@needs(SUPPORTED, MISSING)
def test_route_answers_an_address_the_client_reaches(fleet: Fleet, moved: dict[str, Any]) -> None:
    n1, n2, n3 = (fleet.nodes[n].address for n in NODES)
    assert moved["started"]["endpoint"].startswith(f"{n1}:")
    # The client streamed through the endpoint Route gave it, from its own namespace.
    assert moved["warm"]["routed_endpoint"] == moved["started"]["endpoint"]
    assert moved["warm"]["routed_after"]["endpoint"].startswith(f"{n2}:")
    assert moved["cold"]["routed_endpoint"].startswith(f"{n2}:")
    assert moved["cold"]["routed_after"]["endpoint"].startswith(f"{n3}:")
    assert all(len(t) == TOKENS for t in moved["reference"].values())


@needs(SUPPORTED, MISSING)
@pytest.mark.parametrize(
    ("move", "kind"), [("warm", "STEP_KIND_MIGRATE"), ("cold", "STEP_KIND_COLD_START")]
)
def test_move_across_hosts_keeps_every_token(moved: dict[str, Any], move: str, kind: str) -> None:
    result = moved[move]
    assert result["state"] == "OPERATION_STATE_SUCCEEDED", result["error"]
    assert result["step_kind"] == kind and result["phase"] == "done"
    assert result["sessions_carried"] >= 1, "the move should have caught sessions mid-stream"
    assert result["tokens"] == moved["reference"]


@needs(SUPPORTED, MISSING)
def test_nothing_answers_plaintext_and_workers_refuse_strangers(
    fleet: Fleet, moved: dict[str, Any]
) -> None:
    probes = fleet.client_run("probes")
    assert probes["daemon_plaintext"] == "UNAVAILABLE"
    assert probes["agents_plaintext"] == {name: "UNAVAILABLE" for name in NODES}
    assert list(probes["workers"]) == [moved["cold"]["new_worker_id"]]
    (worker,) = probes["workers"].values()
    assert worker["endpoint"].startswith(f"{fleet.nodes['n3'].address}:")
    for call in ("GetInfo", "CancelSession", "Generate"):
        # The handshake fails: nothing is served without TLS and a client certificate.
        assert worker[f"plaintext:{call}"] == "UNAVAILABLE"
        assert worker[f"tls_no_client_cert:{call}"] == "UNAVAILABLE"
    # Control: the daemon and the worker's own agent only.
    assert worker["daemon:CancelSession"] == "NOT_FOUND"  # reached the worker: no such session
    assert worker["own_node:CancelSession"] == "NOT_FOUND"
    for stranger in ("other_node", "router", "operator"):
        assert worker[f"{stranger}:CancelSession"] == "PERMISSION_DENIED"
    assert worker["other_node:GetInfo"] == "PERMISSION_DENIED"
    # Sessions: the callers the operator listed (routers, by default) only.
    assert worker["router:Generate"] == "OK"
    for stranger in ("other_node", "own_node", "operator", "daemon"):
        assert worker[f"{stranger}:Generate"] == "PERMISSION_DENIED"

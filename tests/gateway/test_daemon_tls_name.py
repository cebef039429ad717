"""``fleetshift gateway --daemon-tls-name``: a replica list over mTLS whose certificates carry a
name other than the host the gateway dials.

A real fleet on mTLS (``LocalFleet(tls=True)``: daemon, one agent, one reference-engine worker
started as the other gateway tests start it) whose daemon certificate carries 127.0.0.1 (what
the agent dials) and the DNS name ``fleetshiftd.test``, not ``localhost``. The gateway is given
the replica list ``localhost:P,127.0.0.1:P`` (two entries reaching the one daemon), so TLS
checks one name for both: the first replica's host, ``localhost``, unless ``--daemon-tls-name``
names another. With the name every replica's certificate carries, an OpenAI request is
answered; without it, or with a wrong one, the client gets a prompt 503 that says the daemon
is unavailable and why (the hostname check), never a hang.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc import pki
from tests.e2e.conftest import MODEL, NODES
from tests.e2e.conftest import model_dir as model_dir  # the session fixture

from .procs import gateway

pytestmark = pytest.mark.slow
SHARED_NAME = "fleetshiftd.test"


@pytest.fixture(scope="module")
def tls_fleet(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalFleet]:
    """A serving worker behind a daemon whose certificate names 127.0.0.1 and SHARED_NAME."""
    root = tmp_path_factory.mktemp("gw-tls-name")
    fleet = LocalFleet(
        root / "fleet",
        (NODES[0],),
        heartbeat_interval_s=0.3,
        node_lost_after_s=5.0,
        daemon_extra=(
            "[planner]\ninterval_s = 0\n"
            f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\nmodel_dir = "{model_dir}"\n'
            "tp_options = [1]\n"
        ),
        agent_extra="worker_compile = false\nworker_threads = 1\n",
        tls=True,
    )
    pki.init_ca(fleet.pki_dir)  # issued before the start: the fleet keeps what it finds
    pki.issue(fleet.pki_dir, "daemon", "fleetshiftd", san_ips=["127.0.0.1"], san_dns=[SHARED_NAME])
    pki.issue(fleet.pki_dir, "router", "gw")
    try:
        fleet.start(timeout_s=120)
        fleet.start_worker(MODEL, fpb.WORKER_ROLE_MIXED, node=NODES[0].name)
        yield fleet
    finally:
        fleet.stop()


def gateway_args(fleet: LocalFleet, *tls_name: str) -> tuple[str, ...]:
    return (
        "--daemon-ca", str(fleet.pki_dir / "ca.crt"),
        "--daemon-cert", str(fleet.pki_dir / "router-gw.crt"),
        "--daemon-key", str(fleet.pki_dir / "router-gw.key"),
        *tls_name,
    )  # fmt: skip


def replica_list(fleet: LocalFleet) -> str:
    """Two entries for the one daemon, the first by a name its certificate does not carry."""
    port = fleet.daemon_port
    resolved = socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)[0][4][0]
    assert resolved == "127.0.0.1", f"this test needs localhost to be 127.0.0.1, not {resolved}"
    return f"localhost:{port},127.0.0.1:{port}"


def complete(url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL, prompt="hello there", max_tokens=4)


def test_the_gateway_reaches_replicas_by_the_name_their_certificates_carry(
    tls_fleet: LocalFleet, model_dir: Path, tmp_path: Path
) -> None:
    daemon = replica_list(tls_fleet)
    named = gateway_args(tls_fleet, "--daemon-tls-name", SHARED_NAME)
    with gateway(tmp_path / "named", daemon, MODEL, model_dir, *named) as url:
        answer = complete(url)
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert answer.choices[0].text


@pytest.mark.parametrize("tls_name", [(), ("--daemon-tls-name", "elsewhere.test")])
def test_without_that_name_a_request_gets_a_prompt_503_naming_the_check(
    tls_fleet: LocalFleet, model_dir: Path, tmp_path: Path, tls_name: tuple[str, ...]
) -> None:
    daemon = replica_list(tls_fleet)
    with gateway(tmp_path, daemon, MODEL, model_dir, *gateway_args(tls_fleet, *tls_name)) as url:
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            complete(url)
        took_s = time.monotonic() - started
    assert refused.value.status_code == 503
    message = str(refused.value)
    assert "the FleetShift daemon is unavailable" in message, message
    assert "Hostname Verification" in message, message
    assert took_s < 10, took_s  # the Route deadline is 5 s; a hang would pass it

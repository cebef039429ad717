"""A client given every replica, over mTLS, fails over from a SIGKILLed replica to a live one.

Three real ``fleetshiftd`` processes on PostgreSQL, each on an address of its own (127.0.0.1,
.2 and .3: all loopback on Linux, as on three hosts), each with a certificate of its own that
``fleetshift certs issue-server`` made carrying every replica's address. The operator runs the
real CLI (``fleetshift --daemon a,b,c --ca --cert --key ...``) and a Python client uses
``fleetshift_rpc.replicas.sync_daemon_channel`` with the same list.

Before fs-17f every handshake on a replica list failed ("Hostname Verification Check failed":
gRPC checked the certificates against the whole address list), so the CLI refused even with
every replica up.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_rpc.replicas import daemon_options, sync_daemon_channel
from fleetshift_rpc.security import client_credentials
from tests.replicas.fleet import SEEDED_MODEL, ReplicaFleet, seeded_fleet

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
SHARED_NAME = "fleetshiftd.test"  # a DNS name every replica's certificate also carries


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetshift_daemon.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def issue_pki(pki: Path, fleet: ReplicaFleet) -> None:
    """The project's own PKI commands, as an operator would run them."""
    assert cli("certs", "init-ca", str(pki)).returncode == 0
    sans = [arg for host in HOSTS for arg in ("--san-ip", host)] + ["--san-dns", SHARED_NAME]
    for index in range(len(HOSTS)):
        name = fleet.replica_cert_name(index)
        issued = cli("certs", "issue-server", str(pki), name, *sans)
        assert issued.returncode == 0, issued.stderr
    assert cli("certs", "issue-operator", str(pki), "alice").returncode == 0


def operator_cli(pki: Path, daemon: str, *command: str) -> subprocess.CompletedProcess[str]:
    tls = ["--ca", str(pki / "ca.crt"), "--cert", str(pki / "operator-alice.crt")]
    tls += ["--key", str(pki / "operator-alice.key")]
    return cli("--daemon", daemon, *tls, *command)


def test_a_client_with_a_replica_list_over_mtls_fails_over_from_a_killed_replica(
    tmp_path: Path, pg_url: str
) -> None:
    pki = tmp_path / "pki"
    fleet = seeded_fleet(tmp_path / "fleet", pg_url, hosts=HOSTS, replica_pki=pki)
    issue_pki(pki, fleet)
    creds = client_credentials(
        str(pki / "ca.crt"), str(pki / "operator-alice.crt"), str(pki / "operator-alice.key")
    )
    replicas = fleet.daemon_address
    try:
        for index in range(len(HOSTS)):
            fleet.start_replica(index, 120)
        assert fleet.leader() == 0
        listed = operator_cli(pki, replicas, "nodes")
        assert listed.returncode == 0 and "n1" in listed.stdout, listed.stdout + listed.stderr
        # the first replica (whose address is the name TLS checks) and the leader, killed
        fleet.kill_replica(0)
        with sync_daemon_channel(replicas, credentials=creds) as ch:
            route = ppb_grpc.PlacementStub(ch).Route
            for _ in range(6):  # round robin: every live replica answers in turn
                request = ppb.RouteRequest(model=SEEDED_MODEL, prompt_tokens=10)
                assert route(request, timeout=10).worker_id == "w1"
            nodes = pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest(), timeout=10)
            assert [n.name for n in nodes.nodes] == ["n1"]
        listed = operator_cli(pki, replicas, "nodes")
        assert listed.returncode == 0 and "n1" in listed.stdout, listed.stdout + listed.stderr
        # --tls-name: the name checked is the one given, not the first replica's host
        named = operator_cli(pki, replicas, "--tls-name", SHARED_NAME, "nodes")
        assert named.returncode == 0 and "n1" in named.stdout, named.stdout + named.stderr
        wrong = operator_cli(pki, replicas, "--tls-name", "elsewhere.test", "nodes")
        assert wrong.returncode != 0 and "Hostname Verification" in wrong.stdout + wrong.stderr
        new = fleet.leader(30)
        assert new in (1, 2)
        # changes of the fleet on the list, and on the surviving follower alone: under TLS a
        # follower names the leader and the CLI re-runs the command there
        follower = fleet.replica_address(3 - new)
        cordoned = operator_cli(pki, replicas, "cordon", "n1", "--reason", "failover test")
        assert cordoned.returncode == 0, cordoned.stdout + cordoned.stderr
        listed = operator_cli(pki, follower, "nodes")
        assert listed.returncode == 0 and "(cordoned)" in listed.stdout, listed.stdout
        uncordoned = operator_cli(pki, follower, "uncordon", "n1")
        assert uncordoned.returncode == 0, uncordoned.stdout + uncordoned.stderr
        assert f"the leader is at {fleet.replica_address(new)}" in uncordoned.stdout
        listed = operator_cli(pki, replicas, "nodes")
        assert listed.returncode == 0 and "(cordoned)" not in listed.stdout, listed.stdout
    finally:
        fleet.stop(workers=False)


def test_the_name_tls_checks_on_a_replica_list() -> None:
    """The first replica's host as written, or the name the caller gives; a single address
    keeps gRPC's own check (the host dialled); plaintext sets nothing."""
    replicas = "127.0.0.1:1,127.0.0.2:2"
    override = "grpc.ssl_target_name_override"
    assert dict(daemon_options(replicas, tls=True))[override] == "127.0.0.1"
    assert dict(daemon_options("a.internal:1,b.internal:2", tls=True))[override] == "a.internal"
    assert dict(daemon_options("[::1]:1,[::1]:2", tls=True))[override] == "::1"
    named = dict(daemon_options(replicas, tls=True, tls_name="fleetshiftd.internal"))
    assert named[override] == "fleetshiftd.internal"
    assert override not in dict(daemon_options(replicas))
    assert override not in dict(daemon_options("127.0.0.2:2", tls=True))

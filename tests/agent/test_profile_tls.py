"""``fleetshift profile --worker`` against a worker with its node's certificate, as on a fleet
with TLS: it dials with the fleet CA and the operator's certificate (``--ca/--cert/--key`` or
the same ``FLEETSHIFT_*`` variables as the rest of the CLI), the operator being listed in the
node's ``worker_session_callers``; and it says what to give when it dials without them or
with a certificate the worker refuses."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetshift_rpc import pki
from tests.agent.worker_process import serving_worker

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root)
    pki.issue(root, "node", "node-a", san_ips=["127.0.0.1"])
    pki.issue(root, "router", "edge")
    pki.issue(root, "operator", "alice")
    pki.issue(root, "operator", "bob")
    return root


@pytest.fixture(scope="module")
def worker(home: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker as the supervisor starts one on a TLS node whose ``worker_session_callers``
    are router "edge" and operator "alice"."""
    port_file = tmp_path_factory.mktemp("w") / "port"
    argv = [
        sys.executable, "-m", "fleetshift_agent.worker", "--model-dir", str(tiny_model),
        "--port-file", str(port_file), "--worker-id", "w-prof", "--no-compile", "--threads", "1",
        "--listen", "127.0.0.1:0", "--node-name", "node-a",
        "--tls-cert", str(home / "node-node-a.crt"), "--tls-key", str(home / "node-node-a.key"),
        "--tls-ca", str(home / "ca.crt"), "--session-caller", "router:edge",
        "--session-caller", "operator:alice", "--max-running", "2", "--num-blocks", "32",
    ]  # fmt: skip
    with serving_worker(argv, port_file, stop_timeout_s=30) as address:
        yield address


def profile(
    worker: str, model: Path, out: Path, *tls: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "fleetshift_daemon.cli.main", "profile", "--worker", worker,
        "--config", str(model), "--out", str(out), "--prompt-sizes", "16",
        "--max-concurrency", "1", "--token-size", "4", "--repeats", "1", "--no-peaks",
        "--no-plot", *tls,
    ]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSHIFT_")}
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env={**clean, **(env or {})}
    )


def test_profile_dials_a_tls_worker_with_the_given_certificate(
    home: Path, worker: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tls.csv"
    done = profile(
        worker, tiny_model, out, "--ca", str(home / "ca.crt"),
        "--cert", str(home / "operator-alice.crt"), "--key", str(home / "operator-alice.key"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["prompt_size"], r["batch_size"]) for r in rows] == [("16", "1")]
    assert float(rows[0]["token_time"]) > 0


def test_profile_takes_the_cli_environment_variables(
    home: Path, worker: str, tiny_model: Path, tmp_path: Path
) -> None:
    env = {
        "FLEETSHIFT_CA": str(home / "ca.crt"),
        "FLEETSHIFT_CERT": str(home / "operator-alice.crt"),
        "FLEETSHIFT_KEY": str(home / "operator-alice.key"),
    }
    done = profile(worker, tiny_model, tmp_path / "env.csv", env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "env.csv").exists()


def test_plaintext_to_a_tls_worker_fails_naming_the_flags(
    worker: str, tiny_model: Path, tmp_path: Path
) -> None:
    done = profile(worker, tiny_model, tmp_path / "plain.csv")
    assert done.returncode == 1, done.stderr
    assert "UNAVAILABLE" in done.stderr and "--ca" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "plain.csv").exists()


@pytest.mark.parametrize(
    "pair",
    ["operator-bob", "router-edge"],
    ids=["operator-the-node-does-not-list", "router-may-not-read-the-worker"],
)
def test_a_certificate_the_worker_refuses_is_named_with_what_to_give(
    home: Path, worker: str, tiny_model: Path, tmp_path: Path, pair: str
) -> None:
    out = tmp_path / "refused.csv"
    done = profile(
        worker, tiny_model, out, "--ca", str(home / "ca.crt"),
        "--cert", str(home / f"{pair}.crt"), "--key", str(home / f"{pair}.key"),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "PERMISSION_DENIED" in done.stderr and "worker_session_callers" in done.stderr
    assert "Traceback" not in done.stderr and "INVALID_ARGUMENT" not in done.stderr
    assert not out.exists()

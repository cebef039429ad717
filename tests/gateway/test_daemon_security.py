"""The gateway in front of a daemon that requires mTLS (certificates from ``fleetshift certs``):
with a router certificate its Route calls are accepted; with an identity the daemon refuses, a
client gets a 502 naming the refusal, and once the daemon rate-limits the refused caller, a
429 whose Retry-After is the daemon's own hint."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fleetshift_agent.engine.make_model import main as make_model

from .procs import gateway

pytestmark = pytest.mark.slow
MODEL = "tiny"
RATE_PER_S = 0.05  # one call per 20 s once the burst is spent: the hint is ~20 s


def certs(*args: str) -> None:
    cmd = [sys.executable, "-m", "fleetshift_daemon.cli.main", "certs", *args]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, Path]]:
    """(pki dir, daemon address, model dir) of a daemon on mTLS with a burst of 2 calls."""
    root = tmp_path_factory.mktemp("gw-tls")
    pki, model_dir = root / "pki", root / "model"
    assert make_model(["--out", str(model_dir), "--preset", MODEL]) == 0
    certs("init-ca", str(pki))
    certs("issue-server", str(pki), "fleetshiftd", "--san-ip", "127.0.0.1")
    certs("issue-router", str(pki), "gw-1")
    certs("issue-node", str(pki), "gpu-node-1", "--san-ip", "127.0.0.1")
    config = root / "daemon.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\nstate_dir = "{root / "d"}"\nport_file = "{root / "d.port"}"\n'
        f'tls_cert = "{pki / "daemon-fleetshiftd.crt"}"\n'
        f'tls_key = "{pki / "daemon-fleetshiftd.key"}"\ntls_ca = "{pki / "ca.crt"}"\n'
        f"rate_limit_burst = 2\nrate_limit_per_s = {RATE_PER_S}\n"
        "[planner]\ninterval_s = 0\n"
        f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\nmodel_dir = "{model_dir}"\n'
        "tp_options = [1]\n"
    )
    cmd = [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)]
    with (root / "daemon.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        port_file = root / "d.port"
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, (
                root / "daemon.log"
            ).read_text()
            time.sleep(0.05)
        yield pki, f"127.0.0.1:{int(port_file.read_text())}", model_dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def test_router_certificate_is_accepted(tls_daemon: tuple[Path, str, Path], tmp_path: Path) -> None:
    pki, daemon, model_dir = tls_daemon
    creds = (
        "--daemon-ca", str(pki / "ca.crt"),
        "--daemon-cert", str(pki / "router-gw-1.crt"), "--daemon-key", str(pki / "router-gw-1.key"),
    )  # fmt: skip
    with gateway(tmp_path, daemon, MODEL, model_dir, *creds) as url:
        # Route is answered (no worker serves the model yet): past TLS and the daemon's table.
        for _ in range(4):  # Route is exempt from the per-caller limit: never a 429 here
            with pytest.raises(openai.InternalServerError) as caught:
                client_of(url).completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert caught.value.status_code == 503
            assert "no capacity" in str(caught.value) and "served by no worker" in str(caught.value)


def test_refused_gateway_gets_502_then_429_with_the_daemons_retry_hint(
    tls_daemon: tuple[Path, str, Path], tmp_path: Path
) -> None:
    pki, daemon, model_dir = tls_daemon
    creds = (  # a node's certificate: valid, but a node may not call Route
        "--daemon-ca", str(pki / "ca.crt"),
        "--daemon-cert", str(pki / "node-gpu-node-1.crt"),
        "--daemon-key", str(pki / "node-gpu-node-1.key"),
    )  # fmt: skip
    with gateway(tmp_path, daemon, MODEL, model_dir, *creds) as url:
        client = client_of(url)
        for _ in range(2):  # the burst: refused for who it is
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert refused.value.status_code == 502
            assert "refused the gateway (PERMISSION_DENIED)" in str(refused.value)
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        reply = limited.value.response
        assert reply.status_code == 429 and "rate limit" in str(limited.value)
        hint_s = int(reply.headers["retry-after"])
        assert 0.5 / RATE_PER_S <= hint_s <= 1 / RATE_PER_S, hint_s
        assert reply.json()["error"]["type"] == "rate_limit_error"

"""Starting a real gateway process for tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    url: str  # the base URL an OpenAI client takes: ``http(s)://127.0.0.1:PORT/v1``


def start_gateway(
    root: Path,
    daemon: str,
    model: str,
    model_dir: Path,
    *extra: str,
    scheme: str = "http",
    prefix: list[str] | None = None,
    python_opts: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> GatewayProcess:
    """A ``fleetshift gateway`` subprocess, once it listens. ``prefix`` runs it under another
    command (``taskset -c 1``), ``python_opts`` go to the interpreter (``-m cProfile -o F``)."""
    root.mkdir(parents=True, exist_ok=True)
    port_file, log = root / "gateway.port", root / "gateway.log"
    port_file.unlink(missing_ok=True)
    cmd = [
        *(prefix or []), sys.executable, *(python_opts or []), "-m", "fleetshift_daemon.cli.main",
        "gateway",
        "--daemon", daemon, "--listen", "127.0.0.1:0", "--port-file", str(port_file),
        "--model", f"{model}={model_dir}", *extra,
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=10)
            raise RuntimeError(f"gateway did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return GatewayProcess(proc, f"{scheme}://127.0.0.1:{int(port_file.read_text())}/v1")


def stop(gw: GatewayProcess, sig: int = signal.SIGTERM) -> None:
    """``SIGINT`` lets a gateway under cProfile write its stats (uvicorn re-raises the signal
    it caught once it has shut down, and a SIGTERM then ends the process where it stands)."""
    if gw.proc.poll() is None:
        gw.proc.send_signal(sig)
    gw.proc.wait(timeout=30)


@contextmanager
def gateway(
    root: Path, daemon: str, model: str, model_dir: Path, *extra: str, scheme: str = "http"
) -> Iterator[str]:
    """A ``fleetshift gateway`` subprocess for the block; yields its base URL."""
    gw = start_gateway(root, daemon, model, model_dir, *extra, scheme=scheme)
    try:
        yield gw.url
    finally:
        stop(gw)

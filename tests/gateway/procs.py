"""Starting a real gateway process for tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def gateway(root: Path, daemon: str, model: str, model_dir: Path, *extra: str) -> Iterator[str]:
    """A ``fleetshift gateway`` subprocess; yields its base URL (``http://127.0.0.1:PORT/v1``)."""
    root.mkdir(parents=True, exist_ok=True)
    port_file, log = root / "gateway.port", root / "gateway.log"
    port_file.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "fleetshift_daemon.cli.main", "gateway", "--daemon", daemon,
        "--listen", "127.0.0.1:0", "--port-file", str(port_file),
        "--model", f"{model}={model_dir}", *extra,
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log.read_text()}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{int(port_file.read_text())}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)

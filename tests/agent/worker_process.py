"""A reference worker started as the supervisor starts one, for tests that dial it directly."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def serving_worker(argv: list[str], port_file: Path, stop_timeout_s: float) -> Iterator[str]:
    """Start ``argv`` (which writes ``port_file`` once it serves), yield its address, stop it.

    Fails the test if the worker exits or has not served within 120 s."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "worker did not serve"
            time.sleep(0.05)
        yield f"127.0.0.1:{int(port_file.read_text())}"
    finally:
        proc.terminate()
        proc.wait(timeout=stop_timeout_s)

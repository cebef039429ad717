"""The main job as a newcomer runs it, and the way it ends.

``fleetshift demo --short`` (what ``./scripts/demo`` runs, shortened) brings up real processes
(daemon, agents, workers, gateway), replays the trace through the official openai client and
must show the daemon's own moves, a summary that checked 0 tokens lost or repeated, and a PNG;
afterwards no process it started may be left. ``fleetshift local-fleet --keep`` (and the demo)
must stop everything they started on SIGTERM, SIGINT and SIGHUP alike. Survivors are found by
an environment marker every descendant inherits (the agents pass their environment on to the
workers), so a process started by anything the command started is seen wherever it re-parented.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
MARK = "FLEETSHIFT_TEST_RUN"


def survivors(mark: str) -> list[str]:
    """Command lines of live processes that carry ``MARK=mark`` in their environment."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found.append(f"{entry.name}: {cmd}")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def launch(args: list[str], out: Path) -> tuple[subprocess.Popen[bytes], str]:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"}
    with out.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetshift_daemon.cli.main", *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
    return proc, mark


def wait_for_text(proc: subprocess.Popen[bytes], out: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in out.read_text(errors="replace"):
        assert proc.poll() is None, f"exited {proc.returncode}:\n{out.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{out.read_text()}"
        time.sleep(0.2)


def assert_no_survivor(mark: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := survivors(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "processes left behind:\n" + "\n".join(left)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"the shared trace {TRACE} is not here")
def test_short_demo_shows_the_loop_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    args = [
        "demo",
        "--short",
        "--no-live",
        "--trace",
        str(TRACE),
        "--state-dir",
        str(tmp_path / "s"),
    ]
    proc, mark = launch(args, out)
    try:
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert code == 0, text
    assert "PLAN op-" in text and "by planner (automatic mode)" in text, text
    assert "MOVE " in text and ": done" in text, text
    assert "tokens lost or repeated in served streams: 0 (checked)" in text, text
    served = next(line for line in text.splitlines() if line.startswith("requests served:"))
    done, of = served.split(":")[1].split("(")[0].split(" of ")
    assert int(done) == int(of) > 0, served
    assert (tmp_path / "s" / "timeline.png").stat().st_size > 10_000
    assert "stopped" in text
    assert_no_survivor(mark)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_local_fleet_keep_stops_everything_on(sig: signal.Signals, tmp_path: Path) -> None:
    out = tmp_path / "fleet.out"
    args = ["local-fleet", "--keep", "--preset", "tiny", "--workers", "1", "--gateway",
            "--state-dir", str(tmp_path / "s")]  # fmt: skip
    proc, mark = launch(args, out)
    try:
        wait_for_text(proc, out, "running; Ctrl-C", 300)
        assert len(survivors(mark)) >= 7  # itself, daemon, 4 agents, a worker, the gateway
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_no_survivor(mark)

"""How the main job and ``local-fleet`` end: ``fleetshift local-fleet --keep`` must stop
everything it started on SIGTERM, SIGINT and SIGHUP alike (the demo shares its handler; the
README test ends a kept demo with SIGTERM the same way). Survivors are found by
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


def assert_the_demo_showed_the_loop(text: str, state_dir: Path) -> None:
    """What a newcomer must see from the demo (``tests/test_readme_commands.py`` runs it
    shortened, as the README's walkthrough starts it, so the suite pays for one demo run)."""
    assert "PLAN op-" in text and "by planner (automatic mode)" in text, text
    assert "MOVE " in text and ": done" in text, text
    assert "tokens lost or repeated in served streams: 0 (checked)" in text, text
    steps = next(line for line in text.splitlines() if line.startswith("steps run:"))
    assert "warm move" in steps or "cold move" in steps, steps  # a worker was relocated
    if int(steps.rsplit("sessions moved:", 1)[1]) == 0:
        # Carrying a session is the likely outcome, not a certain one (README): the router
        # places every stream, and on a quiet machine the tiny model's streams end in about
        # a second (a CI rehearsal saw both operator moves find none open at their copy).
        # A run that carried none must say so and why; carried sessions themselves are
        # checked token for token by tests/e2e/test_moves.py and tests/gateway.
        assert "no stream was open on a moved worker when its target had started" in text, text
    served = next(line for line in text.splitlines() if line.startswith("requests served:"))
    done, of = served.split(":")[1].split("(")[0].split(" of ")
    assert int(done) == int(of) > 0, served
    assert (state_dir / "timeline.png").stat().st_size > 10_000
    assert_the_recovery_is_told_truthfully(text)


def assert_the_recovery_is_told_truthfully(text: str) -> None:
    """The summary says whether the efficiency figure came back, and its claim matches the
    figures it printed. Whether it comes back within the short demo's bound depends on the
    machine's load, so either answer passes; a claim the figures contradict does not."""
    lines = text.splitlines()
    eff = next(line for line in lines if line.startswith("efficiency: lowest"))
    told = next(line.strip() for line in lines if line.strip().startswith("recovered: "))
    end = float(eff.split("at the end ")[1].split()[0])
    threshold = float(eff.split("threshold ")[1].rstrip(")"))
    if told.startswith("recovered: yes"):
        assert end >= threshold, (eff, told)
        assert float(told.split("efficiency ")[1].split()[0]) == end, (eff, told)
        assert "RECOVERED: placement efficiency" in text, text  # the live view said so too
    else:
        assert told.startswith("recovered: no -- ") and len(told) > 30, told
        assert "RECOVERED: placement efficiency" not in text or "fell again" in told, text


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name
)
def test_local_fleet_keep_stops_everything_on(sig: signal.Signals, tmp_path: Path) -> None:
    """SIGTERM with a worker and the gateway; SIGINT and SIGHUP take the same path (one
    handler), so a bare fleet keeps the suite's time down."""
    out = tmp_path / "fleet.out"
    args = ["local-fleet", "--keep", "--state-dir", str(tmp_path / "s")]
    if sig == signal.SIGTERM:
        args += ["--preset", "tiny", "--workers", "1", "--gateway"]
    proc, mark = launch(args, out)
    try:
        wait_for_text(proc, out, "running; Ctrl-C", 300)
        # itself, the daemon, 4 agents (and a worker, make_model's model, the gateway)
        assert len(survivors(mark)) >= (7 if sig == signal.SIGTERM else 6)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_no_survivor(mark)

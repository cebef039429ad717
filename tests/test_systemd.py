"""systemd integration: the sd_notify client against real sockets, and the shipped unit files
checked by systemd's own tools (``systemd-analyze verify`` and ``security --offline``).

Every notifier test binds a real AF_UNIX datagram socket and reads what arrived, the way the
service manager does; the process-level ones start real child processes so the environment
hand-over and the sender's pid are the kernel's, not the test's.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetshift_common.config import agent_config, daemon_config
from fleetshift_common.sdnotify import (
    SdNotifier,
    SdNotifyError,
    child_environ,
    running_under_systemd,
    stderr_is_journal,
    watchdog_interval,
)
from tests.ci import needs

REPO = Path(__file__).resolve().parents[1]
UNITS = REPO / "systemd"
DAEMON_UNIT = UNITS / "fleetshiftd.service"
AGENT_UNIT = UNITS / "fleetshift-agent.service"

# Exposure thresholds stated in docs/systemd.md (measured with systemd 252: 1.1 and 1.6).
DAEMON_MAX_EXPOSURE = 1.5
AGENT_MAX_EXPOSURE = 2.0

# The only checks of `systemd-analyze security` each unit may fail; docs/systemd.md says why.
DAEMON_ACCEPTED = {
    "PrivateNetwork",  # it serves gRPC to the fleet
    "IPAddressDeny",  # the fleet's addresses are not known when the unit is written
    "RestrictAddressFamilies_AF_INET_INET6",
    "RestrictAddressFamilies_AF_UNIX",  # journal, sd_notify, local PostgreSQL
    "RootDirectoryOrRootImage",  # runs from the host's venv
    "DeviceAllow",  # ProtectClock= itself grants char-rtc read access
    "ProcSubset",  # prometheus-client's process metrics read /proc/stat
}
AGENT_ACCEPTED = DAEMON_ACCEPTED | {
    "PrivateDevices",  # needs /dev/nvidia*
    "SupplementaryGroups",  # video, for 0660 root:video NVIDIA nodes
    "MemoryDenyWriteExecute",  # CUDA / Triton JIT
    "PrivateUsers",  # unmapped video group and surviving workers
    "RemoveIPC",  # would destroy the surviving workers' shared memory
    "SystemCallFilter_resources",  # CUDA / NCCL NUMA pinning
}

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = needs(SYSTEMD_ANALYZE is not None, "systemd-analyze (package systemd)")
needs_seccomp = needs(
    ctypes.util.find_library("seccomp") is not None, "libseccomp (package libseccomp2)"
)


# --------------------------------------------------------------------------- helpers


def _receiver(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    # Ask for the sender's credentials, as systemd does to enforce NotifyAccess=main.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    return sock


def _recv(sock: socket.socket) -> tuple[str, int]:
    """One datagram and the pid the kernel says sent it."""
    data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(12))
    pid = -1
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _uid, _gid = struct.unpack("3i", payload[:12])
    return data.decode(), pid


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    address = str(tmp_path / "notify.sock")
    sock = _receiver(address)
    yield address, sock
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, socket.socket]]:
    name = f"fleetshift-test-{uuid.uuid4().hex}"
    sock = _receiver(b"\0" + name.encode())
    yield "@" + name, sock
    sock.close()


def _run_child(
    code: str, env: dict[str, str], stderr: int = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        timeout=60,
        check=True,
    )


# --------------------------------------------------------------------------- the notifier


def test_ready_with_status_arrives_as_one_datagram_on_a_path_socket(
    path_socket: tuple[str, socket.socket],
) -> None:
    address, sock = path_socket
    with SdNotifier.from_env({"NOTIFY_SOCKET": address}) as notifier:
        assert notifier.enabled
        assert notifier.ready(status="serving on :50051, 12 nodes loaded")
        message, pid = _recv(sock)
    assert message == "READY=1\nSTATUS=serving on :50051, 12 nodes loaded"
    assert pid == os.getpid()


def test_every_message_kind_reaches_an_abstract_socket(
    abstract_socket: tuple[str, socket.socket],
) -> None:
    address, sock = abstract_socket
    with SdNotifier.from_env({"NOTIFY_SOCKET": address}) as notifier:
        assert notifier.watchdog()
        assert notifier.status("planning\ncycle 7")
        assert notifier.extend_timeout(45.5)
        assert notifier.stopping(status="draining 3 migrations")
        received = [_recv(sock)[0] for _ in range(4)]
    assert received == [
        "WATCHDOG=1",
        "STATUS=planning cycle 7",  # a newline would have started a bogus assignment
        "EXTEND_TIMEOUT_USEC=45500000",
        "STOPPING=1\nSTATUS=draining 3 migrations",
    ]


def test_without_notify_socket_every_call_is_a_silent_no_op(
    path_socket: tuple[str, socket.socket],
) -> None:
    _address, sock = path_socket
    notifier = SdNotifier.from_env({})
    assert not notifier.enabled
    assert notifier.ready(status="x") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


@pytest.mark.parametrize("value", ["relative/notify.sock", "@", "vsock:2:1234"])
def test_a_malformed_notify_socket_is_a_deployment_error(value: str) -> None:
    with pytest.raises(SdNotifyError, match="NOTIFY_SOCKET"):
        SdNotifier.from_env({"NOTIFY_SOCKET": value})


def test_an_unreachable_manager_does_not_crash_the_service(tmp_path: Path) -> None:
    notifier = SdNotifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    notifier.close()


def test_a_real_child_process_notifies_from_its_own_pid(
    abstract_socket: tuple[str, socket.socket],
) -> None:
    """NotifyAccess=main accepts only datagrams whose kernel-stamped pid is the main pid."""
    address, sock = abstract_socket
    code = (
        "import os; from fleetshift_common.sdnotify import SdNotifier\n"
        "n = SdNotifier.from_env(); n.ready(status=f'pid {os.getpid()}'); print(os.getpid())"
    )
    child = _run_child(code, {"NOTIFY_SOCKET": address})
    message, pid = _recv(sock)
    child_pid = int(child.stdout.strip())
    assert message == f"READY=1\nSTATUS=pid {child_pid}"
    assert pid == child_pid


# --------------------------------------------------------------------------- watchdog


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert (
        watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    )


def test_watchdog_meant_for_another_process_is_ignored() -> None:
    env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert watchdog_interval(env) is None
    assert watchdog_interval(env, pid=os.getpid() + 1) == 15.0


def test_no_watchdog_without_a_positive_watchdog_usec() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    with pytest.raises(SdNotifyError, match="WATCHDOG_USEC"):
        watchdog_interval({"WATCHDOG_USEC": "30s"})
    with pytest.raises(SdNotifyError, match="WATCHDOG_PID"):
        watchdog_interval({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "main"})


def test_watchdog_pid_set_by_the_supervisor_matches_the_exec_ed_service() -> None:
    """Like systemd, the shell names its own pid, then exec()s the service in place."""
    code = "from fleetshift_common.sdnotify import watchdog_interval; print(watchdog_interval())"
    child = subprocess.run(
        [
            "sh",
            "-c",
            'WATCHDOG_PID=$$ WATCHDOG_USEC=20000000 exec "$0" -c "$1"',
            sys.executable,
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert child.stdout.strip() == "10.0"


def test_workers_spawned_with_child_environ_are_neither_watched_nor_notifying(
    abstract_socket: tuple[str, socket.socket],
) -> None:
    address, sock = abstract_socket
    agent_env = {
        "NOTIFY_SOCKET": address,
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "1",
        "FLEETSHIFT_ROLE": "worker",
    }
    worker_env = child_environ(agent_env)
    assert worker_env == {"FLEETSHIFT_ROLE": "worker"}
    code = (
        "from fleetshift_common.sdnotify import SdNotifier, watchdog_interval\n"
        "n = SdNotifier.from_env(); print(n.enabled, n.ready(), watchdog_interval())"
    )
    child = _run_child(code, worker_env)
    assert child.stdout.split() == ["False", "False", "None"]
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


# --------------------------------------------------------------------------- the real daemon

# Runs the real fleetshiftd as systemd would: WATCHDOG_PID names the exec'ed process, and
# MemoryDenyWriteExecute=yes is reproduced with the same seccomp filter (systemd/mdwe-probe.py)
# so a dependency that needs W+X memory fails here rather than on the first production start.
_RUN_AS_UNIT = """
import importlib.util, mmap, runpy, sys
module, config, probe_path = sys.argv[1:4]
if probe_path:
    spec = importlib.util.spec_from_file_location("mdwe_probe", probe_path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    probe._install_seccomp()
    try:
        mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except OSError:
        pass
    else:
        sys.exit("the MemoryDenyWriteExecute filter is not active")
sys.argv = [module, "--config", config]
runpy.run_module(module, run_name="__main__")
"""

_AGENT_TOML = """
daemon_address = "127.0.0.1:9"
inventory = "declared"
[[gpus]]
product_name = "NVIDIA H100 80GB HBM3"
count = 2
"""


def _next(sock: socket.socket, proc: subprocess.Popen[str], deadline_s: float = 60) -> list[str]:
    """The assignments of the next datagram, which must come from the main pid."""
    sock.settimeout(0.5)
    for _ in range(int(deadline_s / 0.5)):
        try:
            message, sender = _recv(sock)
        except TimeoutError:
            if proc.poll() is not None:
                assert proc.stderr is not None
                pytest.fail(f"daemon exited with {proc.returncode}:\n{proc.stderr.read()}")
            continue
        assert sender == proc.pid, f"{message!r} came from pid {sender}, not {proc.pid}"
        return message.splitlines()
    pytest.fail(f"no sd_notify message within {deadline_s}s")


@needs_seccomp
@pytest.mark.parametrize(
    ("module", "extra_toml", "deny_write_execute"),
    [("fleetshift_daemon.main", "", True), ("fleetshift_agent.main", _AGENT_TOML, False)],
    ids=["daemon", "agent"],
)
def test_service_speaks_the_unit_protocol(
    tmp_path: Path,
    abstract_socket: tuple[str, socket.socket],
    module: str,
    extra_toml: str,
    deny_write_execute: bool,
) -> None:
    """Each process as its unit runs it: WATCHDOG_PID names the exec'ed process, and the
    daemon runs under the same W^X seccomp filter MemoryDenyWriteExecute=yes installs, so a
    dependency needing W+X memory fails here rather than at the first production start."""
    address, sock = abstract_socket
    config = tmp_path / "service.toml"
    port_file = tmp_path / "port"
    config.write_text(
        f'listen = "127.0.0.1:0"\nstate_dir = "{tmp_path}"\nport_file = "{port_file}"\n'
        + extra_toml
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
    env |= {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000000"}
    script = 'WATCHDOG_PID=$$ exec "$0" -c "$1" "$2" "$3" "$4"'
    probe = str(UNITS / "mdwe-probe.py") if deny_write_execute else ""
    proc = subprocess.Popen(
        ["sh", "-c", script, sys.executable, _RUN_AS_UNIT, module, str(config), probe],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen: list[str] = []
        while "READY=1" not in seen:
            seen += _next(sock, proc)
        port = int(port_file.read_text())
        assert f"STATUS=serving on port {port}" in seen
        # READY promises an answering server: the port accepts connections right now.
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        # Pings keep coming from the event loop, every half of WATCHDOG_USEC.
        pings = 0
        while pings < 2:
            pings += "WATCHDOG=1" in _next(sock, proc)
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in seen:
            seen += _next(sock, proc)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        stderr = proc.stderr.read()
    assert "Traceback" not in stderr


# --------------------------------------------------------------------------- journal detection


def test_stderr_is_journal_only_for_the_stream_systemd_named() -> None:
    """JOURNAL_STREAM is dev:inode of the journald socket; our logging drops timestamps then."""
    journal_end, service_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with journal_end, service_end:
        st = os.fstat(service_end.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}", "INVOCATION_ID": "0" * 32}
        code = (
            "from fleetshift_common.sdnotify import stderr_is_journal, running_under_systemd\n"
            "print(stderr_is_journal(), running_under_systemd())"
        )
        to_journal = _run_child(code, env, stderr=service_end.fileno())
        redirected = _run_child(code, env)  # the variable survives `2>file`; the stream did not
    assert to_journal.stdout.split() == ["True", "True"]
    assert redirected.stdout.split() == ["False", "True"]
    assert stderr_is_journal({}) is False
    assert stderr_is_journal({"JOURNAL_STREAM": "garbage"}) is False
    assert running_under_systemd({}) is False


# --------------------------------------------------------------------------- unit files


def _system_unit_dir() -> Path:
    for candidate in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (candidate / "multi-user.target").exists():
            return candidate
    pytest.fail("systemd-analyze is installed but no system unit directory holds multi-user.target")


def _verify_root(tmp_path: Path, units: dict[str, str], dropins: dict[str, str]) -> Path:
    """A throw-away root with the host's system units, our units and stub executables.

    ``--root`` makes verify resolve ExecStart= inside this root, so the shipped files are
    checked byte for byte, including that their /opt/fleetshift/bin/... paths are absolute
    and executable there.
    """
    root = tmp_path / "root"
    shutil.copytree(_system_unit_dir(), root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for name, text in units.items():
        (etc / name).write_text(text)
    for rel, text in dropins.items():
        (etc / rel).parent.mkdir(parents=True, exist_ok=True)
        (etc / rel).write_text(text)
    bindir = root / "opt/fleetshift/bin"
    bindir.mkdir(parents=True)
    for exe in ("fleetshiftd", "fleetshift-agent"):
        (bindir / exe).write_text("#!/bin/sh\n")
        (bindir / exe).chmod(0o755)
    return root


def _verify(root: Path, *unit_names: str) -> tuple[int, list[str]]:
    assert SYSTEMD_ANALYZE is not None
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", "--generators=no", f"--root={root}", *unit_names],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    # verify exits 0 on "ignoring" warnings, so any line about our units counts as a failure.
    return proc.returncode, [line for line in lines if "fleetshift" in line]


@needs_analyze
def test_units_and_dropin_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    dropin = UNITS / "fleetshiftd.service.d" / "postgresql.conf.example"
    root = _verify_root(
        tmp_path,
        {DAEMON_UNIT.name: DAEMON_UNIT.read_text(), AGENT_UNIT.name: AGENT_UNIT.read_text()},
        {"fleetshiftd.service.d/postgresql.conf": dropin.read_text()},
    )
    rc, complaints = _verify(root, DAEMON_UNIT.name, AGENT_UNIT.name)
    assert complaints == []
    assert rc == 0


@needs_analyze
def test_verify_check_catches_a_broken_unit(tmp_path: Path) -> None:
    """The verify test above can fail: a typo that systemd would silently ignore is reported."""
    broken = DAEMON_UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystem=strickt")
    broken = broken.replace("/opt/fleetshift/bin/fleetshiftd", "/opt/fleetshift/bin/fleetshift-d")
    root = _verify_root(tmp_path, {DAEMON_UNIT.name: broken}, {})
    _rc, complaints = _verify(root, DAEMON_UNIT.name)
    assert any("strickt" in line for line in complaints)
    assert any("fleetshift-d" in line and "not executable" in line for line in complaints)


def _security(unit: Path) -> tuple[float, set[str]]:
    assert SYSTEMD_ANALYZE is not None
    base = [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager"]
    text = subprocess.run([*base, str(unit)], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", text)
    assert found, f"no overall exposure level in:\n{text}"
    table = subprocess.run(
        [*base, "--json=short", str(unit)], capture_output=True, text=True, timeout=60
    ).stdout
    exposed = {
        item["json_field"]
        for item in json.loads(table)
        if item.get("exposure") not in (None, "0.0")
    }
    return float(found.group(1)), exposed


@needs_analyze
@pytest.mark.parametrize(
    ("unit", "threshold", "accepted"),
    [
        (DAEMON_UNIT, DAEMON_MAX_EXPOSURE, DAEMON_ACCEPTED),
        (AGENT_UNIT, AGENT_MAX_EXPOSURE, AGENT_ACCEPTED),
    ],
    ids=["daemon", "agent"],
)
def test_exposure_stays_under_the_stated_threshold(
    unit: Path, threshold: float, accepted: set[str]
) -> None:
    score, exposed = _security(unit)
    assert score <= threshold
    assert exposed - accepted == set(), "new exposure: document it or harden it"


@needs_analyze
def test_exposure_threshold_rejects_an_unhardened_daemon(tmp_path: Path) -> None:
    """The score assertion has teeth: dropping the sandbox lines pushes the daemon over it."""
    kept = [
        line
        for line in DAEMON_UNIT.read_text().splitlines()
        if not line.startswith(("Protect", "Private", "Restrict", "SystemCall", "Capability"))
    ]
    bare = tmp_path / DAEMON_UNIT.name
    bare.write_text("\n".join(kept) + "\n")
    score, exposed = _security(bare)
    assert score > DAEMON_MAX_EXPOSURE
    assert {"ProtectKernelTunables", "PrivateDevices"} <= exposed - DAEMON_ACCEPTED


def _unit_setting(unit: Path, key: str) -> str:
    values = [
        line.split("=", 1)[1].strip()
        for line in unit.read_text().splitlines()
        if line.startswith(f"{key}=")
    ]
    assert len(values) == 1, f"{unit.name} sets {key}= {len(values)} times"
    return values[0]


def test_example_configs_load_and_use_the_units_state_directories() -> None:
    """The shipped configs are accepted by the real loaders and write where the sandbox lets
    them: under ProtectSystem=strict only StateDirectory= is writable."""
    no_env: dict[str, str] = {}
    daemon = daemon_config(UNITS / "daemon.toml.example", no_env)
    agent = agent_config(UNITS / "agent.toml.example", no_env)
    assert daemon.state_dir == f"/var/lib/{_unit_setting(DAEMON_UNIT, 'StateDirectory')}"
    assert agent.state_dir == f"/var/lib/{_unit_setting(AGENT_UNIT, 'StateDirectory')}"
    assert daemon.listen.endswith(":50051")
    assert agent.listen.endswith(":50052")
    assert agent.daemon_address.endswith(":50051")
    for unit, name in ((DAEMON_UNIT, "daemon.toml"), (AGENT_UNIT, "agent.toml")):
        assert _unit_setting(unit, "ExecStart").endswith(f"--config /etc/fleetshift/{name}")


def test_agent_unit_keeps_workers_alive_across_restarts() -> None:
    """The settings the worker-survival design rests on (docs/systemd.md) are all present."""
    settings = {
        tuple(line.split("=", 1))
        for line in AGENT_UNIT.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    }
    for required in [
        ("KillMode", "process"),
        ("OOMPolicy", "continue"),
        ("RemoveIPC", "no"),
        ("RuntimeDirectoryPreserve", "yes"),
        ("User", "fleetshift-agent"),
    ]:
        assert required in settings
    assert not any(key == "DynamicUser" for key, _ in settings)
    assert not any(key == "MemoryDenyWriteExecute" for key, _ in settings)

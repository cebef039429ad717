"""Hosts on one machine: one network namespace each, joined by a bridge, removed afterwards.

A fleet whose processes share a loopback interface cannot show that an address reported to a
peer is one the peer can reach, or that a port is closed to other machines: every process can
reach every other on 127.0.0.1. Here each "host" is a network namespace of its own with one
interface (``eth0``) on a private bridge and an address from 198.18.0.0/15 (RFC 2544's
benchmarking range, never routed), so traffic between hosts goes through a real network
stack, and a process only reaches what is served on its host's address.

The bridge lives in a namespace of its own too, so the machine's own network (the root
namespace) is never touched and cannot reach the lab: a test that passes cannot have used a
shortcut through it. ``close`` kills every process left in the lab's namespaces (workers run
in their own sessions, so killing an agent leaves them) and deletes the namespaces, which
removes their interfaces; it runs on failure too, and a lab a killed test run left behind is
swept the next time one starts (``sweep_stale``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "fsmh"  # every namespace this harness makes is named fsmh-<pid>-<host>
SUBNET = "198.18.0"  # /24 inside 198.18.0.0/15
IP_TIMEOUT_S = 10.0


def _ip(*args: str, netns: str = "") -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def netns_supported() -> tuple[bool, str]:
    """Whether this process can make namespaces: root, the ``ip`` tool, and a kernel that
    lets it (a container without CAP_SYS_ADMIN does not)."""
    if shutil.which("ip") is None:
        return False, "the 'ip' tool (iproute2)"
    if os.geteuid() != 0:
        return False, "root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        return False, f"permission to create network namespaces ({err})"
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return True, ""


def _namespaces() -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(netns: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    ).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all_in(netns: str) -> None:
    for pid in _pids_in(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _delete(netns: str) -> None:
    _kill_all_in(netns)
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        _ip("netns", "del", netns)


def sweep_stale() -> list[str]:
    """Delete labs of test runs that no longer exist (killed before their ``close``)."""
    swept = []
    for name in _namespaces():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if Path(f"/proc/{parts[1]}").exists():
            continue  # its test run is alive: not ours to remove
        _delete(name)
        swept.append(name)
    return swept


@dataclass(frozen=True)
class Host:
    label: str
    netns: str
    address: str

    def endpoint(self, port: int) -> str:
        return f"{self.address}:{port}"


@dataclass
class Lab:
    """Namespaces on one bridge. Use as a context manager: ``close`` always runs."""

    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    bridge_ns: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}-br")
    _made: list[str] = field(default_factory=list)

    def __enter__(self) -> Lab:
        sweep_stale()
        _ip("netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", netns=self.bridge_ns)
        _ip("link", "set", "br0", "up", netns=self.bridge_ns)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, label: str, last_octet: int) -> Host:
        """A namespace with ``lo`` up and ``eth0`` = 198.18.0.<last_octet>/24 on the bridge."""
        netns = f"{PREFIX}-{os.getpid()}-{label}"
        _ip("netns", "add", netns)
        self._made.append(netns)
        port = f"v-{label}"[:15]
        _ip(
            "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns,
            netns=self.bridge_ns,
        )  # fmt: skip
        _ip("link", "set", port, "master", "br0", "up", netns=self.bridge_ns)
        address = f"{SUBNET}.{last_octet}"
        _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        host = Host(label, netns, address)
        self.hosts[label] = host
        return host

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", host.netns, *argv]

    def popen(
        self, host: Host, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A long-running process on ``host``, its output in ``log``."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                self.command(host, argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run(
        self, host: Host, argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A command on ``host`` that must end within ``timeout_s`` (then it is killed)."""
        return subprocess.run(
            self.command(host, argv), capture_output=True, text=True, timeout=timeout_s, env=env
        )

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for netns in reversed(self._made):
            _delete(netns)
        self._made.clear()
        self.procs.clear()


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the multi-host test ran past its time bound")
    return left

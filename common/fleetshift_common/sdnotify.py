"""Talk to systemd's service manager: readiness, status text, watchdog pings, shutdown.

Both units are ``Type=notify`` with ``WatchdogSec=``, so systemd only calls the daemon "started"
once it says READY=1 (the gRPC server listens and the registry is loaded), and restarts it
when the event loop stops pinging. Announcing readiness ourselves, rather than letting systemd
guess from a fork, is what makes ``After=fleetshiftd.service`` mean "the daemon answers".

The protocol is sd_notify(3): one datagram of newline-separated ``KEY=VALUE`` lines to the
AF_UNIX socket named in ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace).
It is small and stable, so it is written by hand here: the PyPI ``sdnotify`` package has been
unmaintained for years, and ``systemd-python`` needs the libsystemd headers and a C compiler
on every host that installs FleetShift. Pure stdlib keeps ``fleetshift_common`` importable
anywhere, including on hosts without systemd, where every call is a silent no-op.

Sending never raises: a service must not die because its supervisor is briefly unreachable
(for instance during ``systemctl daemon-reexec``). A malformed ``$NOTIFY_SOCKET`` or
``$WATCHDOG_USEC`` does raise, at start-up, because that is a deployment error worth seeing.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Mapping

__all__ = [
    "NOTIFY_ENV_VARS",
    "SdNotifier",
    "SdNotifyError",
    "child_environ",
    "running_under_systemd",
    "stderr_is_journal",
    "watchdog_interval",
]

_log = logging.getLogger(__name__)

#: Variables systemd hands to the main process only; children must not inherit them, or a
#: worker could ping the agent's watchdog (NotifyAccess=main drops it, but the journal logs
#: a warning for every such datagram) and believe it is being watched itself.
NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class SdNotifyError(ValueError):
    """The environment systemd gave us is malformed (a deployment error, not a runtime one)."""


def _socket_address(raw: str) -> str | bytes:
    """Turn ``$NOTIFY_SOCKET`` into an address ``socket.sendto`` accepts."""
    if raw.startswith("/"):
        return raw
    if raw.startswith("@") and len(raw) > 1:
        # Abstract namespace: leading NUL instead of '@', no trailing NUL, no filesystem entry.
        return b"\0" + raw[1:].encode()
    raise SdNotifyError(
        f"NOTIFY_SOCKET={raw!r} is neither an absolute path nor an '@' abstract socket name"
    )


def _clean(value: str) -> str:
    """A field value may not contain newlines: they would start a new assignment."""
    return " ".join(value.splitlines())


class SdNotifier:
    """Sends sd_notify(3) messages; every method is a no-op when there is no socket.

    Built from the environment once at start-up (``SdNotifier.from_env()``); the socket is
    opened on first use and kept, so the watchdog ping costs one ``sendto``.
    """

    def __init__(self, address: str | bytes | None) -> None:
        self._address = address
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SdNotifier:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        return cls(_socket_address(raw) if raw else None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram; True if systemd got it."""
        if self._address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            _log.warning("sd_notify to %r failed: %s", self._address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Start-up is complete: systemd marks the unit active and starts dependants."""
        fields = ["READY=1"]
        if status is not None:
            fields.append(f"STATUS={_clean(status)}")
        return self.notify(*fields)

    def status(self, text: str) -> bool:
        """Free-form one-line state shown by ``systemctl status``."""
        return self.notify(f"STATUS={_clean(text)}")

    def watchdog(self) -> bool:
        """Proof of life; must arrive at least once per ``WatchdogSec=``."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown has begun, so a slow drain is not mistaken for a hang."""
        fields = ["STOPPING=1"]
        if status is not None:
            fields.append(f"STATUS={_clean(status)}")
        return self.notify(*fields)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time in the current start/stop phase (e.g. a long snapshot drain)."""
        if seconds <= 0:
            raise ValueError(f"extend_timeout needs a positive duration, got {seconds}")
        return self.notify(f"EXTEND_TIMEOUT_USEC={round(seconds * 1_000_000)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> SdNotifier:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def watchdog_interval(
    environ: Mapping[str, str] | None = None, pid: int | None = None
) -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when no watchdog is armed for this process.

    Half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3) recommends, so one late tick of a
    busy event loop does not get the service killed. ``$WATCHDOG_PID``, when set, names the
    process the watchdog is meant for; any other process (a worker that inherited the
    environment) is not being watched.
    """
    env = os.environ if environ is None else environ
    raw_usec = env.get("WATCHDOG_USEC", "")
    if not raw_usec:
        return None
    raw_pid = env.get("WATCHDOG_PID", "")
    if raw_pid:
        if not raw_pid.isdigit():
            raise SdNotifyError(f"WATCHDOG_PID={raw_pid!r} is not a process id")
        if int(raw_pid) != (os.getpid() if pid is None else pid):
            return None
    if not raw_usec.isdigit():
        raise SdNotifyError(f"WATCHDOG_USEC={raw_usec!r} is not a number of microseconds")
    usec = int(raw_usec)
    if usec == 0:
        return None
    return usec / 2 / 1_000_000


def child_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment for a spawned worker, without the supervisor's variables."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in NOTIFY_ENV_VARS}


def running_under_systemd(environ: Mapping[str, str] | None = None) -> bool:
    """True when systemd started this process as (part of) a unit.

    systemd sets ``$INVOCATION_ID`` for every unit it runs, so unlike a marker of our own in
    the unit file it cannot drift out of sync with it and also covers ``systemd-run``.
    """
    env = os.environ if environ is None else environ
    return bool(env.get("INVOCATION_ID"))


def stderr_is_journal(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """True when ``fd`` is the very stream systemd connected to journald.

    ``$JOURNAL_STREAM`` holds ``device:inode`` of that stream (systemd.exec(5)). Comparing it
    with ``fstat(fd)`` rather than only testing that it is set matters: the variable is
    inherited by children and survives ``2>file`` redirections, where timestamps are wanted.
    Logging drops its own timestamps when this is true, since journald records them.
    """
    env = os.environ if environ is None else environ
    dev, sep, ino = env.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_dev == int(dev) and st.st_ino == int(ino)

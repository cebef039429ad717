"""Which daemon replica leads: a lease in the database, a fencing token, a local deadline.

Several daemons share one PostgreSQL database; exactly one of them may run the planner, the
executor and the liveness sweep. It holds a lease row whose expiry the *database* judges
(``expires_at`` against the database's own clock, so no two hosts' clocks are compared) and
whose token grows by one at every change of holder. Every write the leader's executor makes
checks that token in the same transaction (``store/lease_store.py``), so the database refuses a
deposed leader's writes even if that leader has not noticed yet.

A leader that cannot renew stops acting *before* the others can see its lease expire: each
renewal attempt is stamped on this process's monotonic clock before it is sent, the database
extends the lease to at least that instant plus ``ttl_s``, and the leader acts only until that
instant plus ``renew_deadline_s`` (< ``ttl_s``). The margin ``ttl_s - renew_deadline_s`` absorbs
the rate difference of two clocks and the time this process needs to cancel its tasks.

This module is the state machine only: the caller runs the loop, talks to the store and is
told by each method whether this replica was elected or deposed. The clock is injected.

The lease is driven from a thread of its own (``replicas.ReplicaLoop``) while the event loop
asks ``acting``/``token`` before every action, so the state is read and changed under a lock:
a reader sees a token together with the deadline that belongs to it, never one without the
other, and only one caller is told DEPOSED for a tenure.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fleetshift_common.errors import FailedPrecondition, InvalidArgument, Unavailable


class Transition(enum.Enum):
    NONE = "none"
    ELECTED = "elected"  # this replica now leads, with a new token
    DEPOSED = "deposed"  # this replica must stop acting now


@dataclass(frozen=True)
class LeaseSettings:
    ttl_s: float = 5.0  # how long a lease lasts after a renewal, on the database's clock
    renew_interval_s: float = 1.0  # how often the leader renews (and followers try to take it)
    renew_deadline_s: float = 3.5  # the leader stops acting this long after its last good renewal

    def __post_init__(self) -> None:
        if not 0 < self.renew_interval_s < self.renew_deadline_s < self.ttl_s:
            raise InvalidArgument(
                "replicas: need 0 < renew_interval_s < renew_deadline_s < lease_ttl_s, got "
                f"{self.renew_interval_s} / {self.renew_deadline_s} / {self.ttl_s}",
                field="replicas",
            )


@dataclass(frozen=True)
class LeaseView:
    """What the store answered to one attempt: who holds the lease now, and with which token."""

    holder: str
    address: str
    token: int
    held_by_me: bool


class Deposed(FailedPrecondition):
    """A write carried a fencing token that is no longer current: another replica leads."""


class NoLeader(Unavailable):
    """No replica holds the lease right now (a takeover is in progress)."""


class Leadership:
    """One replica's view of the lease, driven by the results of its attempts."""

    def __init__(
        self, identity: str, address: str, settings: LeaseSettings, monotonic: Callable[[], float]
    ) -> None:
        self.identity = identity
        self.address = address
        self.settings = settings
        self._monotonic = monotonic
        self._token: int | None = None  # set while this replica leads
        self._acting_until = 0.0
        self._lock = threading.Lock()  # the lease thread writes, the event loop reads
        self.leader_identity = ""
        self.leader_address = ""

    # -- reading ------------------------------------------------------------------------------
    def acting(self) -> bool:
        """True while this replica leads and its local deadline has not passed."""
        with self._lock:
            return self._token is not None and self._monotonic() < self._acting_until

    @property
    def leading(self) -> bool:
        """Whether this replica still believes it leads (``check`` turns it off at the
        deadline); ``acting`` is the one to ask before doing anything."""
        return self._token is not None

    @property
    def tenure_token(self) -> int | None:
        """The token of the lease this replica holds, even past its deadline (to renew it)."""
        return self._token

    def token(self) -> int | None:
        """The fencing token to write with, or None when this replica must not write."""
        with self._lock:
            if self._token is not None and self._monotonic() < self._acting_until:
                return self._token
            return None

    def require_token(self) -> int:
        token = self.token()
        if token is None:
            raise Deposed(
                f"daemon {self.identity} does not lead (leader: {self.leader_address or 'none'})",
                field="leadership",
            )
        return token

    def time_left(self) -> float:
        """Seconds this replica may still act (0 when it does not lead)."""
        with self._lock:
            if self._token is None:
                return 0.0
            return max(0.0, self._acting_until - self._monotonic())

    # -- driving ------------------------------------------------------------------------------
    def observed(self, view: LeaseView, attempt_started: float) -> Transition:
        """The store's answer to an attempt stamped ``attempt_started`` (monotonic)."""
        with self._lock:
            return self._observed(view, attempt_started)

    def _observed(self, view: LeaseView, attempt_started: float) -> Transition:
        self.leader_identity, self.leader_address = view.holder, view.address
        if not view.held_by_me:
            return self._depose() if self._token is not None else Transition.NONE
        deadline = attempt_started + self.settings.renew_deadline_s
        if self._token is not None and view.token != self._token:
            return self._depose()  # a new tenure: the old one's work must end first
        if self._monotonic() >= deadline:  # the answer came too late to act on
            return self._depose() if self._token is not None else Transition.NONE
        elected = self._token is None
        self._token, self._acting_until = view.token, deadline
        return Transition.ELECTED if elected else Transition.NONE

    def lead_for_good(self, view: LeaseView) -> Transition:
        """The sole daemon of an embedded (SQLite) database: it leads until it stops."""
        with self._lock:
            self.leader_identity, self.leader_address = view.holder, view.address
            self._token, self._acting_until = view.token, float("inf")
        return Transition.ELECTED

    def failed(self) -> Transition:
        """An attempt failed (database unreachable): act on until the deadline, no longer."""
        return self.check()

    def check(self) -> Transition:
        """Depose this replica once its local deadline has passed."""
        with self._lock:
            return self._check()

    def _check(self) -> Transition:
        if self._token is not None and self._monotonic() >= self._acting_until:
            return self._depose()
        return Transition.NONE

    def _depose(self) -> Transition:
        self._token = None
        self._acting_until = 0.0
        return Transition.DEPOSED

"""The fleet registry: an in-memory view of every node, kept in step with a durable store.

Hot paths (heartbeats now, routing later) must never wait on a database query, so the view is
the source of reads and the store is written first on every change that matters after a
restart (registration, cordon, liveness transitions). Heartbeat timestamps are the exception:
they change every second per node and are flushed in batches by the periodic sweep, because
losing a few seconds of them in a crash only delays a `lost` verdict, never loses a node.

A change is written to the store before the view is updated, so a failed write leaves the
registry exactly as it was.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from fleetshift_common.errors import InvalidArgument, NotFound
from fleetshift_daemon.core.fleet import (
    NodeRecord,
    NodeState,
    Registration,
    WorkerCounters,
)
from fleetshift_daemon.core.validation import (
    RegistrationLimits,
    check_node_name,
    check_registration,
)


class RegistryStore(Protocol):
    """What the registry needs from durable storage (SQL in production, anything in tests)."""

    def load_nodes(self) -> list[NodeRecord]: ...

    def save_node(self, node: NodeRecord) -> None: ...

    def update_status(self, name: str, state: NodeState, cordoned: bool, reason: str) -> None: ...

    def record_heartbeats(self, seen: Mapping[str, float]) -> None: ...


class NodeNotFound(NotFound):
    pass


@dataclasses.dataclass(frozen=True)
class SilenceGuard:
    """When most of a fleet falls silent at once, suspect the daemon, not the nodes.

    A node turns lost when the daemon has not heard it for the timeout, and a lost node's
    workers get no more traffic. That verdict is about the node only while the daemon hears
    the rest of the fleet: a daemon stalled past the timeout (a saturated host, a long GC
    pause, a starved event loop) or cut off from the fleet hears nobody, and declaring the
    whole fleet lost would turn its own trouble into an outage — every Route answered "no
    capacity" while the nodes serve on. Two saturated replicas under the load bench declared
    809 and 1,000 of 1,000 healthy nodes lost (docs/benchmarks.md). So when more than
    ``fraction`` of the ready nodes are silent in one sweep, in a fleet of at least
    ``min_nodes`` ready nodes, none of them is declared lost until the share falls back
    (Kubernetes' node lifecycle controller stops evicting in a full disruption for the same
    reason). Below ``min_nodes`` one node is too large a share of the fleet to tell the two
    apart, and nodes turn lost as before.
    """

    fraction: float = 0.5
    min_nodes: int = 10

    def holds(self, silent: int, ready: int) -> bool:
        return ready >= self.min_nodes and silent > self.fraction * ready


class Registry:
    def __init__(
        self,
        store: RegistryStore,
        clock: Callable[[], float],
        lost_after_s: float,
        limits: RegistrationLimits | None = None,
        silence_guard: SilenceGuard | None = None,
        hearing: Callable[[], float] | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        # Silences are timed on this clock (core/hearing.py: the wall clock minus the time
        # the daemon's loop was stalled); record times stay on ``clock``.
        self._hearing = hearing or clock
        self._lost_after_s = lost_after_s
        self._silence_guard = silence_guard or SilenceGuard()
        self.silent_unjudged = 0  # silent nodes the last sweep did not declare lost (the guard)
        self._limits = limits or RegistrationLimits()
        self._nodes: dict[str, NodeRecord] = {}
        self._last_seen: dict[str, float] = {}  # liveness clock, in memory only
        self._unflushed: dict[str, float] = {}  # heartbeat times not yet in the store
        self._unwritten: set[str] = set()  # nodes whose state changed, not yet in the store
        self._status_writes = threading.Lock()  # orders status writes (never held on the loop)
        self._lock = threading.RLock()
        self._listeners: list[tuple[Callable[[], None], bool]] = []

    def on_change(self, listener: Callable[[], None], liveness: bool = True) -> None:
        """Called after a node is registered, cordoned or uncordoned, and (unless
        ``liveness`` is False) after a node turns lost or comes back."""
        self._listeners.append((listener, liveness))

    def _changed(self, liveness: bool = False) -> None:
        for listener, wants_liveness in self._listeners:
            if wants_liveness or not liveness:
                listener()

    def load(self) -> None:
        """Read the store into the view. Every node gets a full timeout from now before it can
        turn lost, so a daemon restart never declares healthy nodes lost."""
        heard = self._hearing()
        with self._lock:
            self._nodes = {n.name: n for n in self._store.load_nodes()}
            self._last_seen = dict.fromkeys(self._nodes, heard)

    def refresh(self) -> bool:
        """A follower's catch-up with the store: durable fields (state, cordon, inventory)
        from the store, live ones (workers' counters, the latest heartbeat) kept from memory.
        Nodes it has not heard from get a full timeout from now, as in ``load``."""
        heard = self._hearing()
        stored = self._store.load_nodes()
        with self._lock:
            fresh: dict[str, NodeRecord] = {}
            for node in stored:
                mine = self._nodes.get(node.name)
                if mine is not None:
                    beats = [t for t in (node.last_heartbeat_at, mine.last_heartbeat_at) if t]
                    node = dataclasses.replace(
                        node, workers=mine.workers, last_heartbeat_at=max(beats, default=None)
                    )
                fresh[node.name] = node
                self._last_seen.setdefault(node.name, heard)
            changed = _durable(fresh) != _durable(self._nodes)
            self._nodes = fresh
        if changed:
            self._changed()
        return changed

    def register(self, reg: Registration) -> tuple[NodeRecord, bool]:
        check_registration(reg, self._limits)
        now = self._clock()
        with self._lock:
            known = self._nodes.get(reg.node_name)
            node = NodeRecord(
                name=reg.node_name,
                agent_address=reg.agent_address,
                state=NodeState.READY,
                inventory_source=reg.inventory_source,
                versions=reg.versions,
                gpus=reg.gpus,
                registered_at=known.registered_at if known else now,
                last_heartbeat_at=now,
                cordoned=known.cordoned if known else False,
                cordon_reason=known.cordon_reason if known else "",
            )
            self._store.save_node(node)
            self._nodes[node.name] = node
            self._last_seen[node.name] = self._hearing()
            self._unflushed.pop(node.name, None)
        self._changed()
        return node, known is None

    def heartbeat(
        self, name: str, workers: Sequence[WorkerCounters] = (), record: bool = True
    ) -> NodeRecord:
        """The node is alive. ``record`` False (a follower replica): a lost node comes back
        in this view only; writing that is the leader's (it hears the same heartbeat), and a
        follower's write would be refused by the fence anyway."""
        if not name:
            raise InvalidArgument("node_name must not be empty", field="node_name")
        if len(workers) > self._limits.max_workers_per_heartbeat:
            raise InvalidArgument(
                f"workers lists {len(workers)} entries, the limit is "
                f"{self._limits.max_workers_per_heartbeat}",
                field="workers",
            )
        now = self._clock()
        with self._lock:
            node = self._require(name)
            came_back = node.state is NodeState.LOST
            if came_back and record:
                # Written by the next sweep, off the event loop this runs on: a write here
                # stalled every call for a database round trip per returning node.
                self._unwritten.add(name)
            node = dataclasses.replace(
                node, state=NodeState.READY, last_heartbeat_at=now, workers=tuple(workers)
            )
            self._nodes[name] = node
            self._last_seen[name] = self._hearing()
            self._unflushed[name] = now
        if came_back:
            self._changed(liveness=True)
        return node

    def last_heartbeat(self, name: str) -> float | None:
        """When the node was last heard from (None: unknown node or never)."""
        node = self._nodes.get(name)
        return node.last_heartbeat_at if node else None

    def set_cordon(self, name: str, cordoned: bool, reason: str = "") -> NodeRecord:
        check_node_name(name, self._limits)
        if len(reason) > self._limits.max_text * 4:
            raise InvalidArgument("reason is too long (512 characters at most)", field="reason")
        with self._status_writes, self._lock:
            node = self._require(name)
            reason = reason if cordoned else ""
            self._store.update_status(name, node.state, cordoned, reason)
            node = dataclasses.replace(node, cordoned=cordoned, cordon_reason=reason)
            self._nodes[name] = node
            self._unwritten.discard(name)
        self._changed()
        return node

    def get(self, name: str) -> NodeRecord:
        check_node_name(name, self._limits)
        with self._lock:
            return self._require(name)

    def nodes(self, state: NodeState | None = None, gpu_contains: str = "") -> list[NodeRecord]:
        wanted = gpu_contains.lower()
        nodes: Iterable[NodeRecord] = sorted(self._nodes.values(), key=lambda n: n.name)
        return [
            n
            for n in nodes
            if (state is None or n.state is state)
            and (not wanted or any(wanted in p.lower() for p in n.gpu_products))
        ]

    def sweep(self) -> list[str]:
        """Flush heartbeat times and turn silent nodes `lost`, unless so many are silent at
        once that the daemon suspects itself (``SilenceGuard``; ``silent_unjudged`` says how
        many it spared); returns the names that turned."""
        now = self._hearing()
        turned: list[str] = []
        self._flush_heartbeats()
        with self._lock:
            ready = [n for n in self._nodes.values() if n.state is NodeState.READY]
            silent = [
                n for n in ready if now - self._last_seen.get(n.name, now) > self._lost_after_s
            ]
            held = self._silence_guard.holds(len(silent), len(ready))
            self.silent_unjudged = len(silent) if held else 0
            for node in [] if held else silent:
                self._nodes[node.name] = dataclasses.replace(node, state=NodeState.LOST)
                self._unwritten.add(node.name)
                turned.append(node.name)
        self._flush_statuses()
        if turned:
            self._changed(liveness=True)
        return turned

    def _flush_statuses(self) -> None:
        """Write the states that changed since the last flush (nodes turned lost, lost nodes
        heard again) outside the registry lock: heartbeats take that lock on the event loop,
        and one write per node under it (a whole fleet turning lost or coming back at once)
        stalled every call, Route too, until they fell behind and more nodes turned lost.
        Each write takes the node's state as it is at the time of writing; ``_status_writes``
        keeps a cordon written meanwhile from being overwritten by an older copy. Nodes a
        failed write did not store are kept for the next flush."""
        with self._status_writes:
            with self._lock:
                names, self._unwritten = self._unwritten, set()
                todo = [self._nodes[n] for n in sorted(names) if n in self._nodes]
            for k, node in enumerate(todo):
                try:
                    self._store.update_status(
                        node.name, node.state, node.cordoned, node.cordon_reason
                    )
                except BaseException:
                    with self._lock:
                        self._unwritten.update(n.name for n in todo[k:])
                    raise

    def _flush_heartbeats(self) -> None:
        """Write the heartbeat times gathered since the last flush, outside the lock: every
        heartbeat takes the lock on the daemon's event loop, so a database write under it
        stalled every call the loop serves (Route too) for as long as the write took. Times
        a failed write did not store are kept for the next flush (a newer one wins)."""
        with self._lock:
            batch, self._unflushed = self._unflushed, {}
        if not batch:
            return
        try:
            self._store.record_heartbeats(batch)
        except BaseException:
            with self._lock:
                for name, at in batch.items():
                    self._unflushed[name] = max(at, self._unflushed.get(name, at))
            raise

    def _require(self, name: str) -> NodeRecord:
        node = self._nodes.get(name)
        if node is None:
            raise NodeNotFound(f"node {name!r} is not registered", field="node_name")
        return node


def _durable(nodes: Mapping[str, NodeRecord]) -> dict[str, NodeRecord]:
    """The nodes without their heartbeat times, which change every second."""
    return {n: dataclasses.replace(r, last_heartbeat_at=None) for n, r in nodes.items()}

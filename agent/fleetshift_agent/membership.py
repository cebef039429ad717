"""Keeping this node registered with the daemon, whatever either side does.

The loop registers, then heartbeats at the interval the daemon asks for. A daemon that is down
or restarting is retried with capped exponential backoff and jitter; a daemon that answers
NOT_FOUND to a heartbeat has lost or never had this node (a wiped database, a new replica) and
is simply registered with again, and one that cannot be reached is registered with again
once it can; one that answers too late (a heartbeat past its deadline) is only slow, and is
heartbeaten on without registering again. Registration is idempotent on the daemon's side, so
no operator action is ever needed after a restart of either process.

``daemon_address`` may list several daemon replicas ("a:1,b:2,c:3"). The agent then keeps one
such loop per replica: every replica hears every heartbeat, so each one's in-memory view
(liveness, counters, sessions, which Route and LocateSession read) is current, the leader's
liveness sweep never depends on which replica an agent picked, and a takeover needs no
redirect: the new leader has been hearing the agents all along (docs/replicas.md). Each
loop sends its heartbeats as messages on one HeartbeatStream call it keeps open
(``fleetshift_rpc.heartbeat_stream``: a call per heartbeat cost the daemon more than the
heartbeat), with unary Heartbeat's answers and errors, so nothing below depends on which.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aiorwlock import RWLock

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.config import split_addresses
from fleetshift_rpc.heartbeat_stream import HeartbeatSender
from fleetshift_rpc.server import channel

log = logging.getLogger("fleetshift.agent.membership")

RPC_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Backoff:
    initial_s: float
    max_s: float

    def delays(self) -> BackoffIter:
        return BackoffIter(self)


class BackoffIter:
    def __init__(self, policy: Backoff) -> None:
        self._policy = policy
        self._next = policy.initial_s

    def next(self) -> float:
        delay = self._next * random.uniform(0.8, 1.2)
        self._next = min(self._next * 2, self._policy.max_s)
        return min(delay, self._policy.max_s)


class Membership:
    def __init__(
        self,
        daemon_address: str,
        registration: Callable[[], pb.RegisterNodeRequest],
        heartbeat: Callable[[], pb.HeartbeatRequest],
        backoff: Backoff,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None = None,
        heartbeat_sent: Callable[[pb.HeartbeatRequest], None] = lambda request: None,
        report_lock: RWLock | None = None,
        on_heartbeat: Callable[[str, str, float], None] = lambda daemon, outcome, s: None,
    ) -> None:
        self._addresses = split_addresses(daemon_address)
        self._registered_with: set[str] = set()
        self._heard: dict[str, set[tuple[str, int]]] = {}  # per replica: reports it has heard
        self._registration = registration
        self._heartbeat = heartbeat
        self._backoff = backoff
        self._max_message_bytes = max_message_bytes
        self._credentials = credentials
        self._heartbeat_sent = heartbeat_sent
        # (replica, outcome, seconds) per heartbeat: what the node sees of each replica
        # (AgentMetrics.heartbeat), so a slow replica shows from the agents' side too.
        self._on_heartbeat = on_heartbeat
        # Read-held from building a heartbeat until the daemon has answered it: a worker start
        # or stop, which write-holds it, cannot be overtaken by a report built before it.
        self._report_lock = report_lock or RWLock()
        self.registered = asyncio.Event()
        self.registrations = 0  # how many times this process registered (observability)
        self.interval_s = 1.0  # the heartbeat interval the daemon asked for at registration

    async def run(self) -> None:
        await asyncio.gather(*(self._run_one(address) for address in self._addresses))

    def _set_registered(self, address: str, registered: bool) -> None:
        """``registered`` is set while at least one replica has this node."""
        if registered:
            self._registered_with.add(address)
            self.registered.set()
        else:
            self._registered_with.discard(address)
            if not self._registered_with:
                self.registered.clear()

    async def _run_one(self, address: str) -> None:
        # The channel redials a restarted daemon within the agent's own backoff: gRPC's
        # default (growing to 120 s) left agents unregistered past node_lost_after_s.
        async with channel(
            address,
            self._max_message_bytes,
            self._credentials,
            reconnect_max_s=self._backoff.max_s,
        ) as ch:
            stub = pb_grpc.AgentRegistryStub(ch)
            sender = HeartbeatSender(ch)  # one long-lived call per replica (heartbeat_stream)
            delays = self._backoff.delays()
            while True:
                try:
                    interval = await self._register(stub, address)
                    delays = self._backoff.delays()
                    await self._heartbeat_until_lost(sender, interval, address)
                except grpc.aio.AioRpcError as err:
                    self._set_registered(address, False)
                    delay = delays.next()
                    log.warning(
                        "daemon unreachable (%s); retrying in %.1fs",
                        err.code().name,
                        delay,
                        extra={"daemon": address},
                    )
                    await asyncio.sleep(delay)
                except Exception:  # a bug must not silently end membership: log and go on
                    self._set_registered(address, False)
                    log.exception("membership loop failed; retrying")
                    await asyncio.sleep(delays.next())

    async def _register(self, stub: pb_grpc.AgentRegistryStub, address: str) -> float:
        reply = await stub.RegisterNode(self._registration(), timeout=RPC_TIMEOUT_S)
        self.registrations += 1
        self._set_registered(address, True)
        log.info(
            "registered with the daemon",
            extra={"node": reply.node.name, "new_node": reply.created, "daemon": address},
        )
        self.interval_s = max(reply.heartbeat_interval_ms, 100) / 1000
        return self.interval_s

    async def _send_heartbeat(self, sender: HeartbeatSender, address: str) -> None:
        # Every replica's loop read-holds the lock at once, so one that does not answer holds
        # up no other replica's heartbeats; each gets the full timeout, as a single daemon
        # does. (A 1 s cap, when the loops took turns, timed out every heartbeat to a replica
        # that queued them for over a second under load, and that replica lost the node.)
        timeout = RPC_TIMEOUT_S
        async with self._report_lock.reader:
            request = self._heartbeat()
            try:
                await sender.send(request, timeout)
            except grpc.aio.AioRpcError as err:
                if not _refused_finished_sessions(err):
                    raise
                # A finished session the daemon finds impossible (e.g. longer than the context
                # it knows for the model) must cost the estimator that report, never the
                # node's liveness: the same heartbeat again, without finished sessions.
                log.warning(
                    "daemon refused a finished session (%s); heartbeat sent without them",
                    err.details(),
                    extra={"daemon": address},
                )
                request = _without_finished_sessions(request)
                await sender.send(request, timeout)
            self._acknowledged(address, request)

    def _acknowledged(self, address: str, request: pb.HeartbeatRequest) -> None:
        """Tell the supervisor which reports the daemon side has heard: with replicas, only
        those every replica this node is registered with has heard (the leader among them), so
        an ended worker is not forgotten before the leader learns how it ended."""
        if len(self._addresses) == 1:
            self._heartbeat_sent(request)
            return
        heard = self._heard.setdefault(address, set())
        heard.update((w.worker_id, w.state) for w in request.workers)
        everywhere = set.intersection(*(self._heard.get(a, set()) for a in self._registered_with))
        if not everywhere:
            return
        self._heartbeat_sent(
            pb.HeartbeatRequest(
                node_name=request.node_name,
                workers=[w for w in request.workers if (w.worker_id, w.state) in everywhere],
            )
        )
        for seen in self._heard.values():
            seen -= everywhere

    async def _heartbeat_until_lost(
        self, sender: HeartbeatSender, interval: float, address: str
    ) -> None:
        """Returns when the daemon no longer knows the node; raises when it is unreachable.

        A heartbeat that times out is not a reason to register again: the daemon is there,
        only slow (saturated, paused), and still has the node. Registering again cost it a
        database write per node (the node and its GPU rows) at the moment it could not keep
        up with heartbeats, so every agent's timeouts turned into heavier load; the agent now
        heartbeats on at the interval and registers again only when the daemon says it does
        not know the node, or cannot be reached at all."""
        slow = False
        while True:
            await asyncio.sleep(interval)
            started = time.monotonic()
            try:
                await self._send_heartbeat(sender, address)
                self._on_heartbeat(address, "answered", time.monotonic() - started)
            except grpc.aio.AioRpcError as err:
                self._on_heartbeat(address, _outcome(err), time.monotonic() - started)
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "daemon does not know this node; registering again",
                        extra={"daemon": address},
                    )
                    self._set_registered(address, False)
                    return
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                if not slow:
                    log.warning(
                        "heartbeat timed out: the daemon is slow; heartbeating on",
                        extra={"daemon": address},
                    )
                slow = True
                continue
            if slow:
                log.info("the daemon answers heartbeats again", extra={"daemon": address})
                slow = False


def _outcome(err: grpc.aio.AioRpcError) -> str:
    return {
        grpc.StatusCode.DEADLINE_EXCEEDED: "timed_out",
        grpc.StatusCode.UNAVAILABLE: "unreachable",
        grpc.StatusCode.NOT_FOUND: "not_found",
    }.get(err.code(), "refused")


def _refused_finished_sessions(err: grpc.aio.AioRpcError) -> bool:
    return err.code() == grpc.StatusCode.INVALID_ARGUMENT and ".finished_sessions" in (
        err.details() or ""
    )


def _without_finished_sessions(request: pb.HeartbeatRequest) -> pb.HeartbeatRequest:
    out = pb.HeartbeatRequest()
    out.CopyFrom(request)
    for worker in out.workers:
        del worker.finished_sessions[:]
    return out

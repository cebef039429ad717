"""Keeping this node registered with the daemon, whatever either side does.

The loop registers, then heartbeats at the interval the daemon asks for. A daemon that is down
or restarting is retried with capped exponential backoff and jitter; a daemon that answers
NOT_FOUND to a heartbeat has lost or never had this node (a wiped database, a new replica) and
is simply registered with again. Registration is idempotent on the daemon's side, so no
operator action is ever needed after a restart of either process.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
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
        report_lock: asyncio.Lock | None = None,
    ) -> None:
        self._address = daemon_address
        self._registration = registration
        self._heartbeat = heartbeat
        self._backoff = backoff
        self._max_message_bytes = max_message_bytes
        self._credentials = credentials
        self._heartbeat_sent = heartbeat_sent
        # Held from building a heartbeat until the daemon has answered it: a worker start or
        # stop that takes it too cannot be overtaken by a report built before it.
        self._report_lock = report_lock or asyncio.Lock()
        self.registered = asyncio.Event()
        self.registrations = 0  # how many times this process registered (observability)
        self.interval_s = 1.0  # the heartbeat interval the daemon asked for at registration

    async def run(self) -> None:
        # The channel redials a restarted daemon within the agent's own backoff: gRPC's
        # default (growing to 120 s) left agents unregistered past node_lost_after_s.
        async with channel(
            self._address,
            self._max_message_bytes,
            self._credentials,
            reconnect_max_s=self._backoff.max_s,
        ) as ch:
            stub = pb_grpc.AgentRegistryStub(ch)
            delays = self._backoff.delays()
            while True:
                try:
                    interval = await self._register(stub)
                    delays = self._backoff.delays()
                    await self._heartbeat_until_lost(stub, interval)
                except grpc.aio.AioRpcError as err:
                    self.registered.clear()
                    delay = delays.next()
                    log.warning(
                        "daemon unreachable (%s); retrying in %.1fs",
                        err.code().name,
                        delay,
                        extra={"daemon": self._address},
                    )
                    await asyncio.sleep(delay)
                except Exception:  # a bug must not silently end membership: log and go on
                    self.registered.clear()
                    log.exception("membership loop failed; retrying")
                    await asyncio.sleep(delays.next())

    async def _register(self, stub: pb_grpc.AgentRegistryStub) -> float:
        reply = await stub.RegisterNode(self._registration(), timeout=RPC_TIMEOUT_S)
        self.registrations += 1
        self.registered.set()
        log.info(
            "registered with the daemon",
            extra={"node": reply.node.name, "new_node": reply.created, "daemon": self._address},
        )
        self.interval_s = max(reply.heartbeat_interval_ms, 100) / 1000
        return self.interval_s

    async def _send_heartbeat(self, stub: pb_grpc.AgentRegistryStub) -> None:
        async with self._report_lock:
            request = self._heartbeat()
            await stub.Heartbeat(request, timeout=RPC_TIMEOUT_S)
            self._heartbeat_sent(request)

    async def _heartbeat_until_lost(self, stub: pb_grpc.AgentRegistryStub, interval: float) -> None:
        """Returns when the daemon no longer knows the node; raises when it is unreachable."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self._send_heartbeat(stub)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("daemon does not know this node; registering again")
                    self.registered.clear()
                    return
                raise

"""The CLI follows a follower's leader hint, and asks again when the hint names a dead daemon.

Just after a takeover a follower's view of the lease can still name the leader that died (it
refreshes once a second); a CI rehearsal's `fleetshift cordon` then failed with "no FleetShift
daemon answers" although a new leader was up. Real gRPC servers here: a follower that refuses
with a hint (first the dead address, then the live leader's) and a leader that answers.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_daemon.cli.main import main
from fleetshift_rpc.replicas import LEADER_KEY

LIST_NODES = "/fleetshift.v1.FleetOperator/ListNodes"


class _Follower(grpc.GenericRpcHandler):
    """Refuses every call naming a leader: ``hints`` in turn, then the last one."""

    def __init__(self, hints: list[str]) -> None:
        self.hints, self.asked = hints, 0

    def service(self, details: Any) -> Any:
        def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
            hint = self.hints[min(self.asked, len(self.hints) - 1)]
            self.asked += 1
            context.set_trailing_metadata(((LEADER_KEY, hint),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the leader is at {hint}")

        return grpc.unary_unary_rpc_method_handler(refuse)


class _Leader(grpc.GenericRpcHandler):
    def service(self, details: Any) -> Any:
        if details.method != LIST_NODES:
            return None
        reply = pb.ListNodesResponse(nodes=[pb.Node(name="n1")])
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: reply, response_serializer=lambda m: m.SerializeToString()
        )


def _serve(handler: grpc.GenericRpcHandler) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _dead_address() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def leader() -> Iterator[str]:
    server, address = _serve(_Leader())
    yield address
    server.stop(None)


def test_a_stale_leader_hint_is_asked_again_and_the_command_reaches_the_new_leader(
    leader: str, capsys: pytest.CaptureFixture[str]
) -> None:
    follower = _Follower([_dead_address(), leader])
    server, address = _serve(follower)
    try:
        assert main(["--daemon", address, "nodes"]) == 0
    finally:
        server.stop(None)
    out = capsys.readouterr().out
    assert follower.asked == 2 and "n1" in out, out
    assert "asking the replicas again" in out, out


def test_a_hint_that_stays_dead_ends_with_the_unreachable_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    follower = _Follower([_dead_address()])
    server, address = _serve(follower)
    try:
        assert main(["--daemon", address, "nodes"]) == 1
    finally:
        server.stop(None)
    assert follower.asked == 6  # the first ask and five more, a second apart
    assert "no FleetShift daemon answers" in capsys.readouterr().out

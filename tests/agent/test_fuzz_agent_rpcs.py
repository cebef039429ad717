"""The same property as tests/test_fuzz_rpcs.py, for the node agent's AgentService and
SnapshotService (issue 13): no request crashes it, a request is accepted only within every
bound, and a refused one leaves its snapshot store and its workers as they were.

A real agent (declared H100 inventory, registered with a real daemon) holds one pinned
snapshot, so the fuzzer's names reach real snapshots; strings are never an existing
directory, so no worker process is ever started (that is the slow tests' business).
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fleetshift.v1 import agent_pb2, snapshot_pb2
from fleetshift_agent.app import Agent
from fleetshift_common.config import DaemonConfig
from fleetshift_daemon.app import Daemon
from fleetshift_rpc.validation import check_request
from tests.snapshot.helpers import JSON_PARTS, make_key, sample_tensors
from tests.test_fuzz_rpcs import CRASHES, LoopThread, call_method, message_strategy

from .fleet import agent_config

EXAMPLES = int(os.environ.get("FLEETSHIFT_FUZZ_EXAMPLES", "300")) // 2
SERVICES = [
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"],
    snapshot_pb2.DESCRIPTOR.services_by_name["SnapshotService"],
]
METHODS = [m for s in SERVICES for m in s.methods]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The agent's own address is a name the fuzzer knows: a FetchSnapshot from it is answered at
# once (an unreachable address would spend seconds in the transfer's retries).
SELF = f"127.0.0.1:{_free_port()}"
KNOWN = ["snap-a", "node-a", "w-1", "tiny", "", "ghost", SELF, "manifest.json"]
STRINGS = st.one_of(st.sampled_from(KNOWN), st.text(max_size=24), st.just("n" * 5000)).filter(
    lambda s: not os.path.isdir(s)
)  # an existing directory would start a real worker
CALLS = st.sampled_from(METHODS).flatmap(
    lambda m: st.tuples(st.just(m), message_strategy(m.input_type, strings=STRINGS))
)
TALLY: Counter[str] = Counter(crashes=0, state_changes_from_refused=0)
SECONDS: Counter[str] = Counter()  # time spent in each method's calls


class AgentThread(LoopThread):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.daemon: Daemon | None = None
        self.agent: Agent | None = None

    async def start(self) -> None:
        self.daemon = Daemon(
            DaemonConfig(listen="127.0.0.1:0", state_dir=str(self.root / "daemon"))
        )
        await self.daemon.start()
        config = replace(agent_config(self.daemon.port, "node-a", self.root / "agent"), listen=SELF)
        self.agent = Agent(config)
        await self.agent.start()
        store = self.agent.store
        assert store is not None
        store.write(
            "snap-a",
            key=make_key(),
            spec={"model": "tiny"},
            tensor_groups=sample_tensors(),
            json_parts=JSON_PARTS,
        )
        store.pin("snap-a")  # a fuzzed DeleteSnapshot must not empty the store

    async def stop(self) -> None:
        if self.agent:
            await self.agent.stop(0.1)
        if self.daemon:
            await self.daemon.stop(0.1)

    def beliefs(self) -> tuple[Any, ...]:
        agent = self.agent
        assert agent is not None and agent.store is not None and agent.supervisor is not None

        def read() -> tuple[Any, ...]:
            snaps = tuple((s.snapshot_id, s.size_bytes, s.pinned) for s in agent.store.list())  # type: ignore[union-attr]
            workers = tuple(sorted(agent.supervisor.workers))  # type: ignore[union-attr]
            return snaps, workers

        return self.run(read)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def agent_under_fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentThread, str]]:
    runner = AgentThread(tmp_path_factory.mktemp("agent-fuzz"))
    runner.run(runner.start)
    assert runner.agent is not None
    try:
        yield runner, f"127.0.0.1:{runner.agent.port}"
    finally:
        runner.run(runner.stop)
        runner.close()
        print(f"\nagent fuzz tally: {dict(TALLY)}")
        print(f"seconds per method: { {k: round(v, 1) for k, v in SECONDS.items()} }")


@seed(13)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=CALLS)
def test_no_request_crashes_the_agent_or_changes_it_unless_valid(
    agent_under_fuzz: tuple[AgentThread, str], call: tuple[MethodDescriptor, Message]
) -> None:
    runner, address = agent_under_fuzz
    method, request = call
    with grpc.insecure_channel(address) as ch:
        before = runner.beliefs()
        started = time.monotonic()
        code = call_method(ch, method, request, [])
        SECONDS[method.name] += time.monotonic() - started
        after = runner.beliefs()
    TALLY["tried"] += 1
    TALLY[f"code:{code.name}"] += 1
    if code in CRASHES:
        TALLY["crashes"] += 1
    refused = code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED)
    if refused and before != after:
        TALLY["state_changes_from_refused"] += 1
    assert code not in CRASHES, f"{method.full_name} answered {code.name} to {request!r}"
    if refused:
        assert before == after, f"refused {method.full_name} ({code.name}) changed the agent"
    if code == grpc.StatusCode.OK:
        check_request(request)


def test_fetch_from_a_malformed_address_is_refused_at_once(
    agent_under_fuzz: tuple[AgentThread, str],
) -> None:
    """Found by the property above: 'ghost' spent ~7 s in name resolution and reconnect
    backoff before an UNAVAILABLE; it is not an address at all."""
    _, address = agent_under_fuzz
    request = agent_pb2.FetchSnapshotRequest(source_agent_address="ghost", snapshot_id="s1")
    with grpc.insecure_channel(address) as ch:
        started = time.monotonic()
        stub = ch.unary_unary(
            "/fleetshift.v1.AgentService/FetchSnapshot",
            request_serializer=agent_pb2.FetchSnapshotRequest.SerializeToString,
            response_deserializer=agent_pb2.FetchSnapshotResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            stub(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "source_agent_address must be host:port" in err.value.details()  # type: ignore[attr-defined]
    assert time.monotonic() - started < 5

"""Property: no request a caller can send crashes the daemon or changes what it believes unless
the request was valid (issue 13).

Every method of every daemon service is called with request messages that hypothesis builds
from the protobuf descriptors, so a field added to a ``.proto`` is fuzzed without touching this
file. Numbers are drawn inside, at and beyond their documented bounds
(``fleetshift_common.bounds``) and at the limits of their wire type; strings from the names the
fleet knows, random text and overlong text; enums from their values and any other number.

For each call: the status is never UNKNOWN or INTERNAL; a call is accepted only when every field
lies within its bound; the traffic window's mean lengths stay within the model's context; and a
refused call (any error status) leaves the registry (names, addresses, GPUs, cordons), the worker table, the operation log and
the traffic window exactly as they were. The daemon is the real one (SQLite, its own servicers
and interceptors) on a loopback port, driven from this thread while it runs on its own loop.

CI runs a fixed seed and FLEETSHIFT_FUZZ_EXAMPLES examples (default 300: 5 s of calls on this
2-core machine at load 6, about 25 s at load 12); the longer run recorded in docs/benchmarks.md
sets it higher.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fleetshift.v1 import fleet_pb2, operations_pb2, placement_pb2
from fleetshift_common.bounds import BOUNDS
from fleetshift_common.config import DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_daemon.app import Daemon
from fleetshift_rpc.validation import check_request

EXAMPLES = int(os.environ.get("FLEETSHIFT_FUZZ_EXAMPLES", "300"))
GiB = 1024**3
MODEL = "llama-70b"
CONTEXT = 4096  # the llama2-70b preset's context
SERVICES = [
    fleet_pb2.DESCRIPTOR.services_by_name["AgentRegistry"],
    fleet_pb2.DESCRIPTOR.services_by_name["FleetOperator"],
    placement_pb2.DESCRIPTOR.services_by_name["Placement"],
    placement_pb2.DESCRIPTOR.services_by_name["Planning"],
    operations_pb2.DESCRIPTOR.services_by_name["Operations"],
]
METHODS = [m for s in SERVICES for m in s.methods]
KNOWN = ["node-a", "node-b", "w-a1", "w-b1", MODEL, "", "ghost", "op-1", "sess-1", "k1"]
CRASHES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
TALLY: Counter[str] = Counter(crashes=0, state_changes_from_refused=0)

_TYPE_RANGE: dict[int, tuple[int, int]] = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


# --- strategies from descriptors --------------------------------------------------------------


def _integers(field: FieldDescriptor) -> st.SearchStrategy[int]:
    lo_t, hi_t = _TYPE_RANGE[field.type]
    bound = BOUNDS.get(field.full_name)
    edges = [lo_t, hi_t, 0, 1, -1]
    inside = st.integers(lo_t, hi_t)
    if bound is not None:
        lo, hi = int(bound.lo), int(bound.hi)
        edges += [lo, hi, lo - 1, hi + 1]
        inside = st.integers(max(lo, lo_t), min(hi, hi_t))
    edges = [e for e in edges if lo_t <= e <= hi_t]
    return st.one_of(inside, st.sampled_from(edges), st.integers(lo_t, hi_t))


def _floats(field: FieldDescriptor) -> st.SearchStrategy[float]:
    width = 32 if field.type == FieldDescriptor.TYPE_FLOAT else 64
    bound = BOUNDS.get(field.full_name)
    edges = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 5e-324]
    parts: list[st.SearchStrategy[float]] = [st.floats(width=width)]
    if bound is not None:
        edges += [bound.lo, bound.hi, bound.hi * 1.0001 + 1, bound.lo - 1]
        parts.append(st.floats(bound.lo, bound.hi, width=width))
    if width == 32:
        edges = [e for e in edges if abs(e) < 3e38 or e != e or abs(e) == float("inf")]
    return st.one_of(*parts, st.sampled_from(edges))


STRINGS = st.one_of(st.sampled_from(KNOWN), st.text(max_size=24), st.just("n" * 5000))


def _scalar(field: FieldDescriptor, strings: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    if field.enum_type is not None:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-(2**31), 2**31 - 1))
    if field.type == FieldDescriptor.TYPE_STRING:
        return strings
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in _FLOATS:
        return _floats(field)
    return _integers(field)


def message_strategy(
    descriptor: Descriptor, depth: int = 0, strings: st.SearchStrategy[str] = STRINGS
) -> st.SearchStrategy[Message]:
    """Any message of this type: each field set or not, recursively (3 levels deep)."""
    cls = GetMessageClass(descriptor)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None:
            if field.message_type.full_name.startswith("google.protobuf.") or depth >= 3:
                continue
            value: st.SearchStrategy[Any] = message_strategy(field.message_type, depth + 1, strings)
        else:
            value = _scalar(field, strings)
        optional[field.name] = st.lists(value, max_size=3) if field.is_repeated else value

    def build(values: dict[str, Any]) -> Message:
        msg = cls()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            if field.is_repeated and field.message_type is not None:
                for item in value:
                    getattr(msg, name).add().CopyFrom(item)
            elif field.is_repeated:
                getattr(msg, name).extend(value)
            elif field.message_type is not None:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries({}, optional=optional).map(build)


CALLS = st.sampled_from(METHODS).flatmap(
    lambda m: st.tuples(st.just(m), message_strategy(m.input_type))
)


# --- the daemon, on its own loop --------------------------------------------------------------


class LoopThread:
    """An event loop on its own thread: the servers run there, the test drives them from here
    with blocking gRPC calls, as separate clients would."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class DaemonThread(LoopThread):
    def __init__(self, daemon: Daemon) -> None:
        super().__init__()
        self.daemon = daemon

    def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until no operation a valid earlier call started is still moving workers, so
        what changes during the next call is that call's doing."""
        ops = self.daemon.operations
        assert ops is not None
        deadline = time.monotonic() + timeout_s
        while self.run(lambda: ops.list(unfinished_only=True)) and time.monotonic() < deadline:
            time.sleep(0.02)

    def beliefs(self) -> tuple[Any, ...]:
        """What the daemon believes, without what time alone changes (heartbeat times,
        liveness) or a running operation moves on its own (phases, states)."""
        d = self.daemon
        assert d.registry and d.workers and d.operations and d.placement

        def read() -> tuple[Any, ...]:
            nodes = tuple(
                (n.name, n.agent_address, n.cordoned, n.cordon_reason, n.gpus, n.versions)
                for n in d.registry.nodes()  # type: ignore[union-attr]
            )
            workers = tuple(
                (w.id, w.node, w.spec, w.gpu_indices, w.endpoint)
                for w in d.workers.all()  # type: ignore[union-attr]
            )
            ops = tuple(
                (o.id, o.kind, o.reason, o.idempotency_key)
                for o in d.operations.list(limit=10_000)  # type: ignore[union-attr]
            )
            traffic = tuple(
                (m, s.requests, s.prompt.mean, s.output.mean)
                for m, s in d.placement.traffic.all_stats().items()  # type: ignore[union-attr]
            )
            return nodes, workers, ops, traffic

        return self.run(read)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonThread, str]]:
    state = tmp_path_factory.mktemp("fuzz")
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(state),
        database_url=f"sqlite:///{state / 'fleetshift.db'}",
        heartbeat_interval_s=0.5,
        node_lost_after_s=3600.0,
        models=(ModelConfig(name=MODEL, preset="llama2-70b", tp_options=(4, 8)),),
        planner=PlannerSettings(interval_s=0),
        rate_limit_per_s=1e6,
        rate_limit_burst=1_000_000,
    )
    runner = DaemonThread(Daemon(config))
    runner.run(runner.daemon.start)
    address = f"127.0.0.1:{runner.daemon.port}"
    with grpc.insecure_channel(address) as ch:
        _seed_fleet(ch)
    try:
        yield runner, address
    finally:
        runner.run(lambda: runner.daemon.stop(0.1))
        runner.close()
        print(f"\nfuzz tally: {dict(TALLY)}")


def _seed_fleet(ch: grpc.Channel) -> None:
    """Two registered nodes with one serving worker each, so names the fuzzer draws exist."""
    register = ch.unary_unary(
        "/fleetshift.v1.AgentRegistry/RegisterNode",
        request_serializer=fleet_pb2.RegisterNodeRequest.SerializeToString,
        response_deserializer=fleet_pb2.RegisterNodeResponse.FromString,
    )
    beat = ch.unary_unary(
        "/fleetshift.v1.AgentRegistry/Heartbeat",
        request_serializer=fleet_pb2.HeartbeatRequest.SerializeToString,
        response_deserializer=fleet_pb2.HeartbeatResponse.FromString,
    )
    for node, worker, product in (
        ("node-a", "w-a1", "NVIDIA H100 80GB HBM3"),
        ("node-b", "w-b1", "NVIDIA H200"),
    ):
        gpus = [
            fleet_pb2.Gpu(index=i, product_name=product, memory_bytes=80 * GiB) for i in range(8)
        ]
        register(
            fleet_pb2.RegisterNodeRequest(
                node_name=node,
                agent_address="127.0.0.1:1",
                gpus=gpus,
                inventory_source=fleet_pb2.INVENTORY_SOURCE_DECLARED,
            )
        )
        status = fleet_pb2.WorkerStatus(
            worker_id=worker,
            model=MODEL,
            role=fleet_pb2.WORKER_ROLE_MIXED,
            tensor_parallel=4,
            dtype="bf16",
            gpu_indices=[0, 1, 2, 3],
            endpoint="127.0.0.1:2",
            state=fleet_pb2.WORKER_STATE_SERVING,
        )
        beat(fleet_pb2.HeartbeatRequest(node_name=node, workers=[status]))


def call_method(
    ch: grpc.Channel, method: MethodDescriptor, request: Message, replies: list[Message]
) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    reply_cls = GetMessageClass(method.output_type)
    kwargs = {
        "request_serializer": type(request).SerializeToString,
        "response_deserializer": reply_cls.FromString,
    }
    try:
        if method.server_streaming:
            replies.extend(ch.unary_stream(path, **kwargs)(request, timeout=3))
        else:
            replies.append(ch.unary_unary(path, **kwargs)(request, timeout=10))
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return,attr-defined]
    return grpc.StatusCode.OK


def check_accepted(method: MethodDescriptor, request: Message, replies: list[Message]) -> None:
    """What was accepted lies within every documented bound. A RouteStream answers each of its
    requests apart (a bad one gets an error answer, the stream goes on): only the requests it
    routed must be within bounds."""
    if method.full_name != "fleetshift.v1.Placement.RouteStream":
        check_request(request)
        return
    answers = [a for reply in replies for a in reply.answers]  # type: ignore[attr-defined]
    for item, answer in zip(request.requests, answers, strict=True):  # type: ignore[attr-defined]
        if answer.WhichOneof("answer") == "route":
            check_request(item.route)


@seed(13)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=CALLS)
def test_no_request_crashes_the_daemon_or_changes_it_unless_valid(
    fuzzed: tuple[DaemonThread, str], call: tuple[MethodDescriptor, Message]
) -> None:
    runner, address = fuzzed
    method, request = call
    runner.settle()
    with grpc.insecure_channel(address) as ch:
        before = runner.beliefs()
        replies: list[Message] = []
        code = call_method(ch, method, request, replies)
        after = runner.beliefs()
    TALLY["tried"] += 1
    TALLY["ok" if code == grpc.StatusCode.OK else "refused"] += 1
    TALLY[f"code:{code.name}"] += 1
    if code in CRASHES:
        TALLY["crashes"] += 1
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED) and before != after:
        TALLY["state_changes_from_refused"] += 1
    assert code not in CRASHES, f"{method.full_name} answered {code.name} to {request!r}"
    if code != grpc.StatusCode.OK and code != grpc.StatusCode.DEADLINE_EXCEEDED:
        assert before == after, f"refused {method.full_name} ({code.name}) changed the daemon"
    if code == grpc.StatusCode.OK:  # accepted only within every documented bound
        check_accepted(method, request, replies)
    for _model, _requests, prompt_mean, output_mean in after[3]:
        assert prompt_mean <= CONTEXT and output_mean <= CONTEXT, "the mix left the context"

"""Worker processes on this node: start, stop, watch, and re-adopt after an agent restart.

Workers are separate processes in their own session (``start_new_session``), so an agent that
restarts (an upgrade, a crash, systemd's ``KillMode=process``) leaves them serving. Each worker
has a small JSON record under the agent's state directory (pid, port, spec), written as soon
as the process exists; a starting agent reads them back, checks that the pid is still the
worker it started (its command line names the worker id, else its GetInfo answers with it)
and adopts it, or drops the record. A worker whose start the previous agent never saw finish
is stopped, whether or not it came up since: whoever asked for it was told the start failed,
and a worker nobody knows about must not hold GPUs.

Nothing here decides placement: the daemon says which worker runs where; the supervisor only
makes it so and reports what is actually running. A worker that died or was stopped is
reported once more (FAILED / STOPPED) so the daemon hears about it, then forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
from aiorwlock import RWLock

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import worker_pb2 as wpb
from fleetshift.v1 import worker_pb2_grpc as wpb_grpc
from fleetshift_agent.wire import ROLE_BY_NAME, ROLE_NAME_BY_PB, STATE_TO_PB
from fleetshift_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    FleetShiftError,
    NotFound,
    Unavailable,
)
from fleetshift_common.failpoints import Failpoints
from fleetshift_common.sdnotify import child_environ
from fleetshift_common.vocabulary import WorkerState
from fleetshift_rpc.errors import peer_error
from fleetshift_rpc.security import TlsFiles

log = logging.getLogger("fleetshift.agent.supervisor")

POLL_TIMEOUT_S = 3.0
SNAPSHOT_TIMEOUT_S = 1800.0
ROLES = ROLE_BY_NAME
STARTING, SERVING = WorkerState.STARTING.value, WorkerState.SERVING.value
FAILED, STOPPED = WorkerState.FAILED.value, WorkerState.STOPPED.value
STATES = STATE_TO_PB


@dataclass(frozen=True)
class WorkerLaunch:
    """What the daemon asks this node to run (already validated by the service)."""

    worker_id: str
    model: str
    role: str  # prefill | decode | mixed
    gpu_indices: tuple[int, ...]
    model_dir: str = ""  # cold start
    tp: int = 1
    dtype: str = "bf16"  # the fleet's label (bf16 | fp8 | int4_w), reported as given
    restore_from: str = ""  # warm start: a snapshot directory of this node's store
    origin_snapshot: str = ""  # that snapshot's id
    engine: str = "reference"  # which worker program runs it (fleetshift_agent.engines)
    engine_args_json: str = ""  # that engine's arguments (EngineArgs as JSON)


@dataclass(frozen=True)
class WorkerProcess:
    launch: WorkerLaunch
    pid: int
    port: int  # 0 until the worker serves
    started_at: float
    state: str = STARTING
    # The node address the worker listens on (records written before it existed: loopback).
    host: str = "127.0.0.1"

    @property
    def worker_id(self) -> str:
        return self.launch.worker_id

    @property
    def endpoint(self) -> str:
        """What the daemon, Route's clients and this agent dial: reachable from other hosts
        whenever ``host`` is the node's address."""
        return join_host_port(self.host, self.port) if self.port else ""


@dataclass
class WorkerLive:
    """What the last poll saw; never persisted."""

    counters: pb.WorkerCounters | None = None
    sessions: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()  # finished, no client has read them (yet)
    # Sessions that finished by their own end lately (the worker's last 256 within 120 s),
    # relayed in every heartbeat as they stand: the daemon counts each session id once, so
    # the agent keeps no acknowledgement state and a resent heartbeat doubles nothing.
    finished: tuple[pb.FinishedSession, ...] = ()
    role: int = 0  # the worker's own answer (SetRole may have changed it)
    role_epoch: int = 0  # and how many role changes that answer had seen


@dataclass(frozen=True)
class SupervisorSettings:
    state_dir: Path  # records, port files and logs of this node's workers
    gpus: frozenset[int]  # the GPU indices this node has
    # Declared inventories (CPU nodes): GPU index -> product, which the worker reports as its
    # own so that compatibility keys behave as on the real hardware.
    declared_products: Mapping[int, str] = field(default_factory=dict)
    cuda: bool = False  # NVML inventory: workers run on their GPUs (CUDA_VISIBLE_DEVICES)
    compile: bool = True
    compile_artifacts: bool = False  # warm starts load the snapshot's compiled code
    threads: int = 0
    start_timeout_s: float = 300.0
    vllm_python: str = ""  # the interpreter of vLLM workers' servers; empty: this one
    # Where workers listen: the node's address its peers reach (docs/multihost.md). With TLS
    # they present the node's certificate (``tls``) and take control calls from the daemon
    # and this agent only; plaintext is loopback development.
    host: str = "127.0.0.1"
    node_name: str = ""
    tls: TlsFiles | None = None
    session_callers: tuple[str, ...] = ()

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        """A channel from this agent to one of its workers, as the node (mTLS) when set."""
        if self.tls is None:
            return grpc.aio.insecure_channel(endpoint)
        return grpc.aio.secure_channel(endpoint, self.tls.channel_credentials())


@dataclass
class Supervisor:
    settings: SupervisorSettings
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    live: dict[str, WorkerLive] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _gone: dict[str, WorkerProcess] = field(default_factory=dict)  # to report once more
    _stopping: set[str] = field(default_factory=set)  # not polled: they are shutting down
    # Read-held by each heartbeat from building its report until the daemon answered it, and
    # write-held here for the last step of a start or stop: the daemon hears of a worker
    # serving or stopped from our answer first, and no report built before that change can
    # arrive after it. Reports share it (one per daemon replica, in flight at once), so a
    # replica that does not answer holds up no other replica's heartbeats, only a change.
    reporting: RWLock = field(default_factory=RWLock)
    # Named places where a test can hold or kill the agent inside a start, stop or snapshot
    # (``fleetshift_common.failpoints``); unset in production.
    failpoints: Failpoints = field(default_factory=Failpoints)
    _listeners: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever the set of workers, or a worker's state or role, may have
        changed (the agent's worker gauge follows it)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def counts(self) -> dict[tuple[str, str], int]:
        """Workers this node runs now, by (role, state); the role is the worker's own answer
        when it has given one (SetRole may have changed it)."""
        counts: dict[tuple[str, str], int] = {}
        for worker in self.workers.values():
            live = self.live.get(worker.worker_id)
            role = worker.launch.role
            if live:
                role = ROLE_NAME_BY_PB.get(live.role, role)
            counts[(role, worker.state)] = counts.get((role, worker.state), 0) + 1
        return counts

    async def hit(self, name: str) -> None:
        """A failpoint, off the event loop (a hold must not stop the agent's other calls)."""
        if self.failpoints.armed:
            await asyncio.to_thread(self.failpoints.hit, name)

    def _file(self, worker_id: str, suffix: str) -> Path:
        return self.settings.state_dir / f"{worker_id}{suffix}"

    # -- starting --------------------------------------------------------------------------
    def check(self, launch: WorkerLaunch) -> None:
        """Refuse a launch that clashes with what runs here (id or GPUs), or that the reference
        engine cannot run: it computes on one device (its snapshot key records gpu_count 1 and
        tensor_parallel 1), so on real GPUs a tensor-parallel worker would hold GPUs it never
        uses and load the whole model onto the first. On a declared inventory nothing runs on
        the GPUs (workers compute on the CPU) and the planner's TP choices stay exercisable."""
        if launch.engine == "vllm":
            self._check_vllm(launch)
        elif self.settings.cuda and (launch.tp > 1 or len(launch.gpu_indices) > 1):
            raise FailedPrecondition(
                f"tensor_parallel {launch.tp} on gpu_indices {list(launch.gpu_indices)}: the "
                "reference engine runs on one device; set the model's tp_options = [1]",
                field="tensor_parallel",
            )
        if launch.worker_id in self.workers:
            raise AlreadyExists(
                f"worker_id {launch.worker_id!r} already runs on this node", field="worker_id"
            )
        absent = sorted(set(launch.gpu_indices) - self.settings.gpus)
        if absent:
            raise FailedPrecondition(
                f"gpu_indices {absent} do not exist on this node (it has "
                f"{sorted(self.settings.gpus)})",
                field="gpu_indices",
            )
        for other in self.workers.values():
            held = sorted(set(launch.gpu_indices) & set(other.launch.gpu_indices))
            if held:
                raise FailedPrecondition(
                    f"gpu_indices {held} are held by worker {other.worker_id!r}",
                    field="gpu_indices",
                )

    def _check_vllm(self, launch: WorkerLaunch) -> None:
        """vLLM runs tensor parallel itself on real GPUs; on a declared inventory its CPU
        build would run one process per rank on this host's cores for GPUs that are not
        there, so there a vLLM worker is one rank."""
        if not self.settings.cuda and launch.tp > 1:
            raise FailedPrecondition(
                f"tensor_parallel {launch.tp}: on a declared (CPU) inventory a vLLM worker runs "
                "one rank; set the model's tp_options = [1]",
                field="tensor_parallel",
            )
        if launch.restore_from:
            raise FailedPrecondition(
                "restore_snapshot_id: a vLLM worker starts from its model directory; this "
                "host has no vLLM checkpoint/restore",
                field="restore_snapshot_id",
            )

    async def start(self, launch: WorkerLaunch) -> WorkerProcess:
        """Spawn the worker and return once it serves (its port file exists)."""
        self.check(launch)
        port_file = self._file(launch.worker_id, ".port")
        port_file.unlink(missing_ok=True)
        self._gone.pop(launch.worker_id, None)
        proc = self._spawn(launch, port_file)
        worker = WorkerProcess(launch, proc.pid, 0, time.time(), host=self.settings.host)
        self._procs[launch.worker_id] = proc
        self._record(worker)  # before it serves: a restarted agent must know the pid
        self._changed()
        try:
            port = await _wait_port(port_file, proc, self.settings.start_timeout_s)
            await self.hit("agent:start:serving")  # the worker serves; nobody was told yet
        except BaseException as err:
            await asyncio.to_thread(_terminate, proc.pid, 2.0)
            self._forget(launch.worker_id)
            self._changed()
            if isinstance(err, FleetShiftError):
                tail = _tail(self._file(launch.worker_id, ".log"))
                raise type(err)(f"{err.message}; log tail: {tail}", field=err.field) from None
            raise
        async with self.reporting.writer:
            worker = replace(worker, port=port, state=SERVING)
            self._record(worker)
            self.live[launch.worker_id] = WorkerLive(role=ROLES[launch.role])
        self._changed()
        log.info(
            "worker started", extra={"worker": launch.worker_id, "pid": proc.pid, "port": port}
        )
        return worker

    def _args(self, launch: WorkerLaunch, port_file: Path) -> list[str]:
        if launch.engine == "vllm":
            return self._vllm_args(launch, port_file)
        s = self.settings
        args = self._common_args("fleetshift_agent.worker", launch, port_file)
        args += ["--compile" if s.compile else "--no-compile"]
        if launch.restore_from:
            args += ["--restore-from", launch.restore_from, "--no-restore-sessions"]
            args += ["--compile-artifacts" if s.compile_artifacts else "--no-compile-artifacts"]
        else:
            args += ["--model-dir", launch.model_dir]
        if s.cuda:
            args += ["--device", "cuda"]
        return args

    def _vllm_args(self, launch: WorkerLaunch, port_file: Path) -> list[str]:
        """The vLLM shim (fleetshift_agent.vllm_worker), which starts vLLM's server beside it."""
        s = self.settings
        args = self._common_args("fleetshift_agent.vllm_worker", launch, port_file)
        args += [
            "--model-dir", launch.model_dir,
            "--engine-args", launch.engine_args_json,
            "--vllm-python", s.vllm_python or sys.executable,
            "--tp", str(launch.tp),
            "--start-timeout-s", str(s.start_timeout_s),
        ]  # fmt: skip
        if s.cuda:
            args.append("--cuda")
        return args

    def _common_args(self, module: str, launch: WorkerLaunch, port_file: Path) -> list[str]:
        """What every engine's worker process is told: where to listen and report its port,
        who it is, how it serves (the node's certificate and who may call it; both engines
        take the same flags, ``fleetshift_agent.worker.security_args``) and the node's
        placement facts (a declared GPU, its thread budget)."""
        s = self.settings
        args = [
            sys.executable, "-m", module,
            "--listen", join_host_port(s.host, 0),
            "--port-file", str(port_file),
            "--worker-id", launch.worker_id,
            "--role", launch.role,
            "--model-id", launch.model,
            "--node-name", s.node_name,
        ]  # fmt: skip
        if s.tls is not None:
            args += ["--tls-cert", s.tls.cert, "--tls-key", s.tls.key, "--tls-ca", s.tls.ca]
        for caller in s.session_callers:
            args += ["--session-caller", caller]
        declared = s.declared_products.get(launch.gpu_indices[0], "")
        if declared:
            args += ["--declared-gpu", declared]
        if s.threads:
            args += ["--threads", str(s.threads)]
        return args

    def _spawn(self, launch: WorkerLaunch, port_file: Path) -> subprocess.Popen[bytes]:
        env = {**child_environ(), "PYTHONUNBUFFERED": "1"}
        if self.settings.threads:
            env["OMP_NUM_THREADS"] = str(self.settings.threads)
        if self.settings.cuda:  # NVML numbers GPUs in PCI bus order; make CUDA agree
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, launch.gpu_indices))
        with self._file(launch.worker_id, ".log").open("ab") as out:
            return subprocess.Popen(
                self._args(launch, port_file),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # survives the agent; one group to signal
            )

    # -- stopping --------------------------------------------------------------------------
    async def stop(self, worker_id: str, grace_s: float = 5.0) -> WorkerProcess:
        """SIGTERM the worker's process group, SIGKILL it after ``grace_s``."""
        worker = self.get(worker_id)
        self._stopping.add(worker_id)
        try:
            await asyncio.to_thread(_terminate, worker.pid, grace_s)
            proc = self._procs.get(worker_id)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(proc.wait, 5)
        finally:
            self._stopping.discard(worker_id)
        await self.hit("agent:stop:stopped")  # the process is gone; the daemon not yet told
        async with self.reporting.writer:
            stopped = replace(worker, state=STOPPED)
            self._forget(worker_id)
            self._gone[worker_id] = stopped
        self._changed()
        log.info("worker stopped", extra={"worker": worker_id})
        return stopped

    def _forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.live.pop(worker_id, None)
        self._procs.pop(worker_id, None)
        for suffix in (".json", ".port"):
            self._file(worker_id, suffix).unlink(missing_ok=True)

    def get(self, worker_id: str) -> WorkerProcess:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise NotFound(f"worker_id {worker_id!r} does not run on this node", field="worker_id")
        return worker

    def serving(self, worker_id: str) -> WorkerProcess:
        worker = self.get(worker_id)
        if worker.state != SERVING:
            raise FailedPrecondition(
                f"worker_id {worker_id!r} is {worker.state}, not serving", field="worker_id"
            )
        return worker

    # -- adoption --------------------------------------------------------------------------
    async def adopt(self) -> list[str]:
        """Take back the workers a previous agent process left running."""
        adopted: list[str] = []
        for record in sorted(self.settings.state_dir.glob("*.json")):
            worker = _load_record(record)
            if worker is None or not _alive(worker.pid):
                record.unlink(missing_ok=True)
                continue
            if not await _is_worker(worker, self.settings):
                log.warning("dropping stale worker record", extra={"worker": record.stem})
                record.unlink(missing_ok=True)
                continue
            if worker.state == STARTING:  # its StartWorker failed with the old agent
                log.warning(
                    "stopping a worker whose start was interrupted",
                    extra={"worker": worker.worker_id},
                )
                await asyncio.to_thread(_terminate, worker.pid, 2.0)
                self._forget(worker.worker_id)
                continue
            self.workers[worker.worker_id] = worker
            self.live[worker.worker_id] = WorkerLive(role=ROLES[worker.launch.role])
            adopted.append(worker.worker_id)
        if adopted:
            log.info("re-adopted running workers", extra={"workers": adopted})
        self._changed()
        return adopted

    def _record(self, worker: WorkerProcess) -> None:
        self.workers[worker.worker_id] = worker
        tmp = self._file(f".{worker.worker_id}", ".json.tmp")
        tmp.write_text(json.dumps(asdict(worker)))
        os.replace(tmp, self._file(worker.worker_id, ".json"))

    # -- observation -----------------------------------------------------------------------
    async def poll(self) -> None:
        """Refresh counters and sessions of every worker; the dead ones become FAILED."""
        serving = [
            w
            for w in self.workers.values()
            if w.state == SERVING and w.worker_id not in self._stopping
        ]
        await asyncio.gather(*(self._poll_one(w) for w in serving))
        self._changed()  # deaths and role changes the poll saw

    async def _poll_one(self, worker: WorkerProcess) -> None:
        if self._dead(worker):
            log.error("worker process is gone", extra={"worker": worker.worker_id})
            self._forget(worker.worker_id)
            self._gone[worker.worker_id] = replace(worker, state=FAILED)
            return
        live = self.live.setdefault(worker.worker_id, WorkerLive())
        try:
            async with self.settings.channel(worker.endpoint) as ch:
                stub = wpb_grpc.WorkerServiceStub(ch)
                counters, info = await asyncio.gather(
                    stub.GetCounters(wpb.GetWorkerCountersRequest(), timeout=POLL_TIMEOUT_S),
                    stub.GetInfo(wpb.GetWorkerInfoRequest(), timeout=POLL_TIMEOUT_S),
                )
        except grpc.aio.AioRpcError as err:
            log.warning(
                "worker did not answer",
                extra={"worker": worker.worker_id, "code": err.code().name},
            )
            return
        live.counters, live.sessions = counters, tuple(info.session_ids)
        live.unread = tuple(info.unread_session_ids)
        live.finished = tuple(info.finished_sessions)
        live.role, live.role_epoch = info.role, info.role_epoch

    def _dead(self, worker: WorkerProcess) -> bool:
        proc = self._procs.get(worker.worker_id)
        if proc is not None and proc.poll() is not None:  # our child: reaped here
            return True
        return not _alive(worker.pid)

    def status(self, worker: WorkerProcess) -> pb.WorkerStatus:
        launch = worker.launch
        live = self.live.get(worker.worker_id, WorkerLive())
        out = pb.WorkerStatus(
            worker_id=launch.worker_id,
            model=launch.model,
            role=live.role or ROLES[launch.role],  # type: ignore[arg-type]
            role_epoch=live.role_epoch,
            tensor_parallel=launch.tp,
            dtype=launch.dtype,
            gpu_indices=list(launch.gpu_indices),
            endpoint=worker.endpoint,
            state=STATES[worker.state],  # type: ignore[arg-type]
            origin_snapshot=launch.origin_snapshot,
            session_ids=list(live.sessions) if worker.state == SERVING else [],
            unread_session_ids=list(live.unread) if worker.state == SERVING else [],
            finished_sessions=list(live.finished) if worker.state == SERVING else [],
        )
        if live.counters is not None and worker.state == SERVING:
            out.counters.CopyFrom(live.counters)
        return out

    def statuses(self) -> list[pb.WorkerStatus]:
        """Every worker this node runs, and the ones that ended since the last heartbeat."""
        return [self.status(w) for w in _by_id([*self.workers.values(), *self._gone.values()])]

    def reported(self, statuses: Iterable[pb.WorkerStatus]) -> None:
        """The daemon has heard these: ended workers among them are forgotten now."""
        for status in statuses:
            gone = self._gone.get(status.worker_id)
            if gone is not None and STATES[gone.state] == status.state:
                del self._gone[status.worker_id]

    # -- worker calls ----------------------------------------------------------------------
    async def snapshot(
        self, worker_id: str, root: Path, snapshot_id: str
    ) -> wpb.WorkerSnapshotResponse:
        worker = self.serving(worker_id)
        request = wpb.WorkerSnapshotRequest(dir=str(root), snapshot_id=snapshot_id)
        try:
            async with self.settings.channel(worker.endpoint) as ch:
                stub = wpb_grpc.WorkerServiceStub(ch)
                reply = await stub.Snapshot(request, timeout=SNAPSHOT_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            raise _from_status(err, worker_id) from None
        await self.hit("agent:snapshot:written")  # in the store; the caller not yet answered
        return reply


# A worker's refusal passes through with its own status; anything else means it is unwell.
# A worker's refusals the agent's caller should see as they are; anything else (a worker that
# does not answer, or fails) is UNAVAILABLE.
_WORKER_PASSES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)


def _from_status(err: grpc.aio.AioRpcError, worker_id: str) -> FleetShiftError:
    return peer_error(err, f"worker {worker_id!r}", passes=_WORKER_PASSES, default=Unavailable)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _by_id(workers: Iterable[WorkerProcess]) -> list[WorkerProcess]:
    return sorted(workers, key=lambda w: w.worker_id)


async def _wait_port(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        port = _read_port(path)
        if port is not None:
            return port
        if proc.poll() is not None:
            raise FailedPrecondition(
                f"worker exited with status {proc.returncode} before it served",
                field="worker_id",
            )
        await asyncio.sleep(0.05)
    raise Unavailable(f"worker did not serve within {timeout_s:.0f} s", field="worker_id")


def _read_port(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text())
    return None


def _tail(path: Path, lines: int = 5) -> str:
    """What a worker that failed to start last said: the exception that ended it when its log
    ends in a traceback (one sentence, not the cut-off frames), else its last lines."""
    with contextlib.suppress(OSError):
        said = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if any(line.startswith("Traceback (most recent call last)") for line in said):
            name, colon, message = said[-1].partition(": ")
            return f"{name.rsplit('.', 1)[-1]}{colon}{message}"
        return " | ".join(said[-lines:])
    return "(no log)"


async def _is_worker(worker: WorkerProcess, settings: SupervisorSettings) -> bool:
    """Is ``worker.pid`` still that worker (and not a reused pid)?"""
    try:
        argv = Path(f"/proc/{worker.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    if argv:
        want = worker.worker_id.encode()
        return any(a == b"--worker-id" and b == want for a, b in itertools.pairwise(argv))
    if not worker.port:  # no /proc and no port: nothing to ask
        return False
    try:
        async with settings.channel(worker.endpoint) as ch:
            stub = wpb_grpc.WorkerServiceStub(ch)
            info = await stub.GetInfo(wpb.GetWorkerInfoRequest(), timeout=POLL_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return False
    return bool(info.worker_id == worker.worker_id)


def _load_record(path: Path) -> WorkerProcess | None:
    try:
        data = json.loads(path.read_text())
        raw = data["launch"]
        launch = WorkerLaunch(**{**raw, "gpu_indices": tuple(raw["gpu_indices"])})
        return WorkerProcess(**{**data, "launch": launch})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return "Z" not in line.split(":", 1)[1]  # a zombie is gone
    return True


def _terminate(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the worker's process group, SIGKILL it after the grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)

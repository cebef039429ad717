"""A whole fleet on one machine: the daemon on SQLite plus agents with declared inventories,
optionally models, workers of them and an OpenAI-compatible gateway.

It is the harness of the main demo (``fleetshift demo``), of ``fleetshift local-fleet`` and of
the end-to-end tests, so it runs the real console entry points as separate processes
(killable, restartable) rather than in-process objects: what it shows is what systemd would
run. Every process it starts leads its own process group, so stopping the fleet signals whole
groups, and ``stop_on_signals`` turns SIGTERM and SIGHUP into the same orderly stop as Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift.v1 import operations_pb2
from fleetshift.v1 import operations_pb2_grpc as operations_grpc
from fleetshift_rpc import pki
from fleetshift_rpc.security import client_credentials


@dataclass(frozen=True)
class NodeSpec:
    name: str
    product_name: str
    gpu_count: int = 8


DEFAULT_NODES: tuple[NodeSpec, ...] = (
    NodeSpec("a100-1", "NVIDIA A100-SXM4-80GB"),
    NodeSpec("h100-1", "NVIDIA H100 80GB HBM3"),
    NodeSpec("h100-2", "NVIDIA H100 80GB HBM3"),
    NodeSpec("h200-1", "NVIDIA H200"),
)


@dataclass(frozen=True)
class ServedModel:
    """A model the local fleet serves: its name, the reference-engine directory the workers
    load, and how the daemon plans it (``plan_as``: a preset architecture such as
    ``llama2-70b``, so a small CPU model is placed as a large one would be on the declared
    GPUs; empty: the directory's own ``config.json``)."""

    name: str
    model_dir: Path
    plan_as: str = ""
    tp_options: tuple[int, ...] = (1,)
    slo_ttft_ms: float = 2000.0
    slo_tbt_ms: float = 100.0

    def toml(self) -> str:
        arch = f'preset = "{self.plan_as}"' if self.plan_as else f'hf_config = "{self.model_dir}"'
        return (
            f'[[models]]\nname = "{self.name}"\n{arch}\nmodel_dir = "{self.model_dir}"\n'
            f"tp_options = [{', '.join(map(str, self.tp_options))}]\n"
            f"slo_ttft_ms = {self.slo_ttft_ms}\nslo_tbt_ms = {self.slo_tbt_ms}\n"
        )


def parse_model_option(text: str) -> tuple[str, Path]:
    """``NAME=DIR`` as ``--model`` takes it; a clear error naming the option otherwise."""
    name, sep, folder = text.partition("=")
    if not sep or not name.strip() or not folder.strip():
        raise ValueError(f"--model wants NAME=DIR, got {text!r}")
    path = Path(folder).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {text}: {path} holds no config.json (make one with --preset)")
    return name.strip(), path


def make_model(out: Path, preset: str, seed: int = 0) -> Path:
    """A seeded reference model (weights, config.json, tokenizer.json) written by the agent's
    own ``make_model`` in a child process (the daemon does not import the agent)."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    cmd = [sys.executable, "-m", "fleetshift_agent.engine.make_model", "--out", str(out)]
    subprocess.run(
        [*cmd, "--preset", preset, "--seed", str(seed)],
        check=True,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    return out


class FleetStopRequested(KeyboardInterrupt):
    """A stop signal arrived: unwind like Ctrl-C so every ``finally`` stops the fleet."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGHUP raise ``FleetStopRequested``, so
    Ctrl-C, ``kill PID`` or a closed terminal stops the fleet instead of leaving its processes
    behind. SIGINT is set too because a job started with ``&`` from a script inherits it
    ignored. The old handlers come back on the way out."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise FleetStopRequested(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP while the fleet is being stopped: a second Ctrl-C
    must not abandon the stop half-way and orphan what is left."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_for(path: Path, timeout_s: float, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout_s}s")


@dataclass
class LocalFleet:
    state_dir: Path
    nodes: Sequence[NodeSpec] = DEFAULT_NODES
    heartbeat_interval_s: float = 1.0
    node_lost_after_s: float = 5.0
    daemon_port: int = 0  # 0: pick a free port on first start, then keep it across restarts
    daemon_extra: str = ""  # TOML appended to the daemon's config (models, planner ...)
    agent_extra: str = ""  # TOML appended to every agent's config (before its [[gpus]])
    env: dict[str, str] = field(default_factory=dict)  # extra environment (failpoints ...)
    # True: every process serves /metrics on a loopback port of its own, kept across restarts
    # ("daemon" or the node name -> port), so a test can scrape what Prometheus would.
    metrics: bool = False
    metrics_ports: dict[str, int] = field(default_factory=dict)
    # True: every process serves mTLS with certificates of a CA made under ``state_dir/pki``
    # (the daemon's, one per node, all for 127.0.0.1), and the harness calls the daemon with
    # operator certificate "localfleet"; ``credentials`` issues any other identity a test
    # calls with (a router, a stranger).
    tls: bool = False
    daemon_proc: subprocess.Popen[bytes] | None = None
    agent_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    gateway_proc: subprocess.Popen[bytes] | None = None
    gateway_port: int = 0
    extra_procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def daemon_address(self) -> str:
        return f"127.0.0.1:{self.daemon_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    def _pair(self, kind: str, name: str) -> Path:
        """``pki_dir/<kind>-<name>`` (.crt and .key), issued on first use."""
        if not (self.pki_dir / "ca.crt").exists():
            pki.init_ca(self.pki_dir)
        stem = self.pki_dir / f"{kind}-{name}"
        if not stem.with_suffix(".crt").exists():
            servers = kind in ("daemon", "node")
            pki.issue(self.pki_dir, kind, name, san_ips=["127.0.0.1"] if servers else [])
        return stem

    def credentials(
        self, kind: str = "operator", name: str = "localfleet"
    ) -> grpc.ChannelCredentials:
        """Client credentials of a certificate of this fleet's CA (``tls`` fleets)."""
        stem = self._pair(kind, name)
        return client_credentials(
            str(self.pki_dir / "ca.crt"), cert=f"{stem}.crt", key=f"{stem}.key"
        )

    def channel(self) -> grpc.Channel:
        """A channel to the daemon as the harness's operator (plaintext unless ``tls``)."""
        if self.tls:
            return grpc.secure_channel(self.daemon_address, self.credentials())
        return grpc.insecure_channel(self.daemon_address)

    def _tls_lines(self, kind: str, name: str) -> str:
        if not self.tls:
            return ""
        stem = self._pair(kind, name)
        return (
            f'tls_cert = "{stem}.crt"\ntls_key = "{stem}.key"\n'
            f'tls_ca = "{self.pki_dir / "ca.crt"}"\n'
        )

    def _spawn(self, module: str, config: Path, log_name: str) -> subprocess.Popen[bytes]:
        return self._spawn_args([module, "--config", str(config)], log_name)

    def _spawn_args(self, args: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(logs / f"{log_name}.log", "ab") as out:  # the child keeps its own copy
            return subprocess.Popen(
                [sys.executable, "-m", *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() signals the group
            )

    def _metrics_line(self, process: str) -> str:
        if not self.metrics:
            return ""
        if process not in self.metrics_ports:
            self.metrics_ports[process] = _free_port()
        return f'metrics_listen = "127.0.0.1:{self.metrics_ports[process]}"\n'

    def start_daemon(self, timeout_s: float = 60.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.state_dir / "daemon.port"
        port_file.unlink(missing_ok=True)
        config = self.state_dir / "daemon.toml"
        config.write_text(
            f'listen = "127.0.0.1:{self.daemon_port}"\n'
            f'state_dir = "{self.state_dir / "daemon"}"\n'
            f'port_file = "{port_file}"\n'
            f"heartbeat_interval_s = {self.heartbeat_interval_s}\n"
            f"node_lost_after_s = {self.node_lost_after_s}\n"
            f"liveness_check_interval_s = {min(0.5, self.heartbeat_interval_s)}\n"
            + self._metrics_line("daemon")
            + self._tls_lines("daemon", "fleetshiftd")
            + self.daemon_extra
        )
        self.daemon_proc = self._spawn("fleetshift_daemon.main", config, "daemon")
        self.daemon_port = _wait_for(port_file, timeout_s, self.daemon_proc)
        self.wait_serving(timeout_s)

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)  # type: ignore[attr-defined]
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"daemon not SERVING within {timeout_s}s")

    def start_agent(self, spec: NodeSpec, timeout_s: float = 60.0) -> None:
        port_file = self._spawn_agent(spec)
        _wait_for(port_file, timeout_s, self.agent_procs[spec.name])

    def _spawn_agent(self, spec: NodeSpec) -> Path:
        port_file = self.state_dir / f"agent-{spec.name}.port"
        port_file.unlink(missing_ok=True)
        config = self.state_dir / f"agent-{spec.name}.toml"
        backoff_max = max(0.5, self.node_lost_after_s / 4)
        config.write_text(
            f'node_name = "{spec.name}"\n'
            'listen = "127.0.0.1:0"\n'
            f'daemon_address = "{self.daemon_address}"\n'
            f'state_dir = "{self.state_dir / ("agent-" + spec.name)}"\n'
            'inventory = "declared"\n'
            f'port_file = "{port_file}"\n'
            f"reconnect_max_s = {backoff_max}\n"
            + self._metrics_line(spec.name)
            + self._tls_lines("node", spec.name)
            + self.agent_extra
            + f'[[gpus]]\nproduct_name = "{spec.product_name}"\ncount = {spec.gpu_count}\n'
        )
        self.agent_procs[spec.name] = self._spawn(
            "fleetshift_agent.main", config, f"agent-{spec.name}"
        )
        return port_file

    def start(self, timeout_s: float = 60.0) -> None:
        """The daemon, then every agent at once (they start in parallel), until all are READY."""
        self.start_daemon(timeout_s)
        ports = {spec.name: self._spawn_agent(spec) for spec in self.nodes}
        for name, port_file in ports.items():
            _wait_for(port_file, timeout_s, self.agent_procs[name])
        self.wait_ready({s.name for s in self.nodes}, timeout_s)

    def start_worker(
        self, model: str, role: int, node: str = "", tensor_parallel: int = 0
    ) -> pb.WorkerStatus:
        """``Operations/StartWorker``, as an operator would: the daemon picks the GPUs (and the
        node, when ``node`` is empty) and the agent spawns the worker."""
        request = operations_pb2.StartFleetWorkerRequest(
            model=model,
            role=role,  # type: ignore[arg-type]
            node_name=node,
            tensor_parallel=tensor_parallel,
        )
        with self.channel() as ch:
            status: pb.WorkerStatus = operations_grpc.OperationsStub(ch).StartWorker(
                request, timeout=300
            )
            return status

    def start_gateway(self, models: Sequence[ServedModel], timeout_s: float = 60.0) -> int:
        """``fleetshift gateway`` for ``models`` on a free loopback port; returns the port."""
        port_file = self.state_dir / "gateway.port"
        port_file.unlink(missing_ok=True)
        args = ["fleetshift_daemon.cli.main", "gateway", "--daemon", self.daemon_address]
        args += ["--listen", "127.0.0.1:0", "--port-file", str(port_file)]
        for model in models:
            args += ["--model", f"{model.name}={model.model_dir}"]
        self.gateway_proc = self._spawn_args(args, "gateway")
        self.gateway_port = _wait_for(port_file, timeout_s, self.gateway_proc)
        return self.gateway_port

    def start_bare_worker(self, model_dir: Path, name: str, timeout_s: float = 300.0) -> str:
        """A reference-engine worker of no agent and no daemon (nothing routes to it or moves
        it), with the agents' worker settings; stopped with the fleet. Returns its address."""
        port_file = self.state_dir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        args = ["fleetshift_agent.worker", "--model-dir", str(model_dir), "--model-id", name]
        args += ["--listen", "127.0.0.1:0", "--port-file", str(port_file), "--no-compile"]
        args += ["--threads", "1"]
        proc = self._spawn_args(args, name)
        self.extra_procs.append(proc)
        return f"127.0.0.1:{_wait_for(port_file, timeout_s, proc)}"

    def list_nodes(self) -> list[pb.Node]:
        with self.channel() as ch:
            reply = pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5)
            return list(reply.nodes)

    def wait_state(self, names: set[str], state: int, timeout_s: float) -> list[pb.Node]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nodes = self.list_nodes()
                if names <= {n.name for n in nodes if n.state == state}:
                    return nodes
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(names)} not in state {state} in {timeout_s}s")
            time.sleep(0.1)

    def wait_ready(self, names: set[str], timeout_s: float) -> list[pb.Node]:
        return self.wait_state(names, pb.NODE_STATE_READY, timeout_s)

    def kill_daemon(self) -> None:
        _kill(self.daemon_proc, signal.SIGKILL)

    def kill_agent(self, name: str) -> None:
        _kill(self.agent_procs.pop(name, None), signal.SIGKILL)

    def stop(self, workers: bool = True) -> None:
        """SIGTERM everything (graceful stop), SIGKILL what has not exited after a grace.

        Workers outlive their agent by design (an agent restart must not kill them), so a
        local fleet that is done also ends the workers its agents recorded."""
        procs = [*self.extra_procs, self.gateway_proc, *self.agent_procs.values(), self.daemon_proc]
        running = [p for p in procs if p is not None]
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill(proc, signal.SIGKILL)
            _signal_group(proc, signal.SIGKILL)  # anything the process left in its group
        self.agent_procs.clear()
        self.extra_procs.clear()
        self.gateway_proc = None
        if workers:
            self._end_workers()

    def _end_workers(self) -> None:
        for record in self.state_dir.glob("agent-*/workers/*.json"):
            try:
                pid = int(json.loads(record.read_text())["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each worker leads its own process group


def _free_port() -> int:
    """A loopback port free right now (the process that binds it next is ours)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def venv_bin() -> str:
    """This environment's script folder as one would type it here: relative when it lies under
    the current directory (``.venv/bin`` in a checkout), else absolute. Never resolved through
    symlinks, since a venv's python is a link to the system's."""
    folder = Path(sys.executable).absolute().parent
    try:
        return str(folder.relative_to(Path.cwd()))
    except ValueError:
        return str(folder)


def explore_commands(fleet: LocalFleet, model: str = "") -> list[str]:
    """Copy-pasteable commands against this running fleet, with its real ports."""
    bin_dir, addr = venv_bin(), fleet.daemon_address
    cmds = [
        f"{bin_dir}/fleetshift --daemon {addr} nodes",
        f"{bin_dir}/fleetshift --daemon {addr} workers",
        f"{bin_dir}/fleetshift --daemon {addr} efficiency",
        f"{bin_dir}/fleetshift --daemon {addr} operations",
        f"{bin_dir}/grpcurl -plaintext {addr} list",
        f"{bin_dir}/grpcurl -plaintext -d '{{}}' {addr} fleetshift.v1.Planning/PlanRebalance",
    ]
    if fleet.gateway_proc is not None and model:
        body = f'{{"model":"{model}","prompt":"hello fleet","max_tokens":16}}'
        cmds += [
            f"curl -s {fleet.gateway_url}/models",
            f"curl -s {fleet.gateway_url}/completions -H 'content-type: application/json' "
            f"-d '{body}'",
        ]
    return cmds


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the process group ``proc`` leads (it was started in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _kill(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    proc.wait(timeout=10)

"""Process configuration: one TOML file per process, overridden by environment variables.

Both processes start from a frozen dataclass so a typo fails at start with the key named,
instead of being silently ignored and surfacing as odd behaviour hours later. Environment
variables win over the file so systemd drop-ins and containers can adjust one value without
rewriting the file; they are parsed with the same type rules as the TOML values.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from fleetshift_common.engines import ENGINES, REFERENCE
from fleetshift_common.errors import InvalidArgument


class ConfigError(InvalidArgument):
    """A configuration value is missing, unknown or of the wrong type; ``field`` names it."""


T = TypeVar("T")

MiB = 1024 * 1024


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"config key '{name}' must be > 0, got {value}", field=name)


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"config key '{name}' must be host:port, got {value!r}", field=name)


def split_addresses(value: str) -> list[str]:
    """``"a:1, b:2"`` -> ``["a:1", "b:2"]``: a daemon address may list every replica."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    return addresses or [value]


def _unspecified(host: str) -> bool:
    """0.0.0.0 / :: / empty: a bind-everything address, never one a peer can dial."""
    return host.strip("[]") in ("", "0.0.0.0", "::")


def _dialable_host(host: str) -> bool:
    """A host name or an IP literal (IPv6 with or without brackets), not a bind-all address
    and not ``host:port``."""
    if _unspecified(host) or any(c.isspace() for c in host):
        return False
    if ":" not in host:
        return True
    try:
        ipaddress.IPv6Address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _check_optional_addresses(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value:
            _check_address(name, value)


@dataclasses.dataclass(frozen=True)
class DeclaredGpu:
    """GPUs written in an agent's config for a machine without NVML (tests, demos, CPU nodes)."""

    product_name: str
    count: int = 1
    memory_gb: float | None = None  # None: take the figure of the known product
    compute_capability: str | None = None
    nvlink: bool | None = None

    def __post_init__(self) -> None:
        if not self.product_name.strip():
            raise ConfigError("gpus.product_name must not be empty", field="gpus.product_name")
        if not 1 <= self.count <= 64:
            raise ConfigError(f"gpus.count must be 1..64, got {self.count}", field="gpus.count")
        if self.memory_gb is not None and not 0 < self.memory_gb <= 1024:
            raise ConfigError(
                f"gpus.memory_gb must be in (0, 1024], got {self.memory_gb}", field="gpus.memory_gb"
            )


@dataclasses.dataclass(frozen=True)
class GpuPrice:
    """The operator's price of one GPU-hour of a kind (the catalogue's defaults are examples)."""

    kind: str
    per_hour: float

    def __post_init__(self) -> None:
        _check_positive("gpu_prices.per_hour", self.per_hour)


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Arguments of a model's engine (``[models.engine_args]``). The reference engine takes
    none; the vllm engine turns them into its server's flags (docs/vllm.md). Values vLLM
    itself checks (a dtype, a length beyond the model's) are passed as given, so the refusal
    comes from vLLM, by name, when the worker starts."""

    dtype: str = "auto"  # vLLM --dtype
    max_model_len: int = 0  # 0: the model's own max_position_embeddings
    kv_cache_gib: float = 1.0  # KV cache size (VLLM_CPU_KVCACHE_SPACE on a CPU)
    gpu_memory_utilization: float = 0.0  # on CUDA: vLLM's share of the GPU; 0: vLLM's default
    enforce_eager: bool = True  # False: vLLM compiles (minutes of warm-up on a CPU)
    kv_connector: str = ""  # vLLM KV connector, e.g. "ExampleConnector" (disk), "NixlConnector"
    kv_role: str = "kv_both"
    kv_connector_path: str = ""  # ExampleConnector's shared_storage_path
    # FleetShiftDiskConnector: an export of a session's KV that no import used is deleted
    # after this long (an imported one at once). Long against a move's export-to-import gap
    # (seconds), short against a disk filling up with exports of moves that rolled back.
    kv_store_ttl_s: float = 600.0
    extra_args: tuple[str, ...] = ()  # further vLLM server flags, passed as given

    def __post_init__(self) -> None:
        if self.max_model_len < 0:
            raise ConfigError(
                "engine_args.max_model_len must be >= 0", field="engine_args.max_model_len"
            )
        _check_positive("engine_args.kv_cache_gib", self.kv_cache_gib)
        _check_positive("engine_args.kv_store_ttl_s", self.kv_store_ttl_s)
        if not 0 <= self.gpu_memory_utilization <= 1:
            raise ConfigError(
                "engine_args.gpu_memory_utilization must be in [0, 1]",
                field="engine_args.gpu_memory_utilization",
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineArgs:
        """Strict: an unknown key or a value of the wrong type is refused, named."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"engine_args is not JSON: {exc}", field="engine_args") from None
        result: EngineArgs = _coerce_item("engine_args", raw, cls)
        return result


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model the fleet serves: its architecture (HF config.json or a named preset) and SLOs."""

    name: str
    hf_config: str = ""  # path to a Hugging Face config.json (or its model directory)
    preset: str = ""  # a known architecture, e.g. "llama2-70b", when no config file is at hand
    dtypes: tuple[str, ...] = ("bf16",)
    tp_options: tuple[int, ...] = (1, 2, 4, 8)
    min_workers: int = 0
    slo_ttft_ms: float = 2000.0
    slo_tbt_ms: float = 100.0
    model_dir: str = ""  # where agents load the weights from (the reference engine's directory)
    # The engine that serves it (``fleetshift_common.engines``): it decides which tp_options
    # are real on GPUs; the daemon refuses the others there and labels them on declared fleets.
    engine: str = REFERENCE
    # That engine's arguments (docs/vllm.md); the reference engine takes none.
    engine_args: EngineArgs = EngineArgs()

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ConfigError("models.name must not be empty", field="models.name")
        if self.engine not in ENGINES:
            raise ConfigError(
                f"model {self.name!r}: unknown engine {self.engine!r} "
                f"(known: {', '.join(sorted(ENGINES))})",
                field="models.engine",
            )
        if bool(self.hf_config) == bool(self.preset):
            raise ConfigError(
                f"model {self.name!r}: set exactly one of hf_config and preset",
                field="models.hf_config",
            )
        if self.min_workers < 0:
            raise ConfigError("models.min_workers must be >= 0", field="models.min_workers")
        for key in ("slo_ttft_ms", "slo_tbt_ms"):
            _check_positive(f"models.{key}", getattr(self, key))
        if not self.tp_options or any(t not in (1, 2, 4, 8) for t in self.tp_options):
            raise ConfigError(
                "models.tp_options must be a subset of 1, 2, 4, 8", field="models.tp_options"
            )


@dataclasses.dataclass(frozen=True)
class PlannerSettings:
    interval_s: float = 30.0  # how often the efficiency figure is recomputed
    threshold: float = 0.95  # efficiency under this is a gap worth closing
    hold_s: float = 300.0  # ... once it has stayed under the threshold this long
    horizon_s: float = 3600.0  # the gain must beat the cost of moving over this horizon
    automatic: bool = False  # execute proposed plans without an operator
    # Stop the workers a plan no longer wants (drained first, never a model's last one); off,
    # they keep serving until an operator stops them. Saves money where GPUs bill by the hour.
    retire_surplus: bool = False
    drain_timeout_s: float = 600.0  # a retirement rolls back if sessions outlive this
    max_moves_in_flight: int = 2
    max_moves_per_node: int = 1
    max_moves_per_model: int = 1

    def __post_init__(self) -> None:
        for key in ("interval_s", "hold_s", "horizon_s", "drain_timeout_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"planner.{key} must be >= 0", field=f"planner.{key}")
        if not 0 < self.threshold <= 1:
            raise ConfigError("planner.threshold must be in (0, 1]", field="planner.threshold")


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """Daemon replicas on one PostgreSQL database (docs/replicas.md); SQLite: one daemon."""

    advertise_address: str = ""  # what other replicas forward to; empty: the bound listen address
    lease_ttl_s: float = 5.0  # a leader's lease, on the database's clock
    renew_interval_s: float = 1.0  # renewals (leader) and takeover attempts (followers)
    renew_deadline_s: float = 3.5  # a leader that could not renew for this long stops acting
    view_refresh_s: float = 0.5  # how often a follower re-reads the database into its view
    # ...and reads every view whatever the mark says at least this often: defence in depth,
    # since the mark is exact (store/view_mark.py); each such read of 1,000 nodes costs about
    # 0.9 s of CPU beside the Route calls a follower serves (docs/replicas.md).
    view_full_read_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.renew_interval_s < self.renew_deadline_s < self.lease_ttl_s:
            raise ConfigError(
                "replicas: need 0 < renew_interval_s < renew_deadline_s < lease_ttl_s, got "
                f"{self.renew_interval_s} / {self.renew_deadline_s} / {self.lease_ttl_s}",
                field="replicas",
            )
        _check_positive("replicas.view_refresh_s", self.view_refresh_s)
        _check_positive("replicas.view_full_read_s", self.view_full_read_s)
        if self.advertise_address:
            _check_address("replicas.advertise_address", self.advertise_address)


@dataclasses.dataclass(frozen=True)
class ProcessKeys:
    """Keys every FleetShift process has: message limits, logging, security, metrics."""

    max_message_bytes: int = 4 * MiB
    port_file: str = ""  # when set, the bound port is written here (tests, local fleets)
    log_format: str = "auto"  # auto | json | text
    # Security (docs/security.md): mTLS when all three TLS files are set, else loopback only.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    read_only_open: bool = False
    rate_limit_per_s: float = 50.0
    rate_limit_burst: int = 100
    rate_limit_max_clients: int = 10_000
    metrics_listen: str = ""  # host:port of the Prometheus endpoint; empty: none

    def _check_process_keys(self) -> None:
        _check_positive("max_message_bytes", self.max_message_bytes)
        _check_optional_addresses(self, ("metrics_listen",))
        if self.log_format not in ("auto", "json", "text"):
            raise ConfigError(
                "config key 'log_format' must be auto, json or text", field="log_format"
            )


@dataclasses.dataclass(frozen=True)
class DaemonConfig(ProcessKeys):
    listen: str = "127.0.0.1:50051"
    state_dir: str = "/var/lib/fleetshift"
    database_url: str = ""  # empty: SQLite file under state_dir
    heartbeat_interval_s: float = 2.0
    node_lost_after_s: float = 10.0
    liveness_check_interval_s: float = 1.0
    # More than this share of the ready nodes silent at once (in a fleet of at least
    # mass_silence_min_nodes): the daemon suspects itself or its network, not the nodes, and
    # declares none of them lost until the share falls back. 1.0 turns the guard off.
    mass_silence_fraction: float = 0.5
    mass_silence_min_nodes: int = 10
    # A stopped or failed worker's record is deleted this long after it ended (the sweep):
    # long enough to inspect it, short enough that moves do not grow the registry forever.
    ended_worker_retention_s: float = 3600.0
    # Finished operations (the audit record; an idempotency key is honoured this long) and
    # efficiency samples are deleted this long after they finished or were taken.
    history_retention_s: float = 7 * 86400.0
    models: tuple[ModelConfig, ...] = ()
    planner: PlannerSettings = PlannerSettings()
    gpu_prices: tuple[GpuPrice, ...] = ()
    operator_listen: str = ""  # TLS-only port for operators with bearer tokens
    operator_tokens_file: str = ""
    replicas: ReplicaSettings = ReplicaSettings()

    def __post_init__(self) -> None:
        _check_address("listen", self.listen)
        for name in (
            "heartbeat_interval_s",
            "node_lost_after_s",
            "liveness_check_interval_s",
            "ended_worker_retention_s",
            "history_retention_s",
        ):
            _check_positive(name, getattr(self, name))
        if not 0 < self.mass_silence_fraction <= 1:
            raise ConfigError(
                "config key 'mass_silence_fraction' must be in (0, 1] (1 turns the guard off), "
                f"got {self.mass_silence_fraction}",
                field="mass_silence_fraction",
            )
        if self.mass_silence_min_nodes < 1:
            raise ConfigError(
                "config key 'mass_silence_min_nodes' must be at least 1, "
                f"got {self.mass_silence_min_nodes}",
                field="mass_silence_min_nodes",
            )
        if self.node_lost_after_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "config key 'node_lost_after_s' must exceed 'heartbeat_interval_s' "
                f"({self.node_lost_after_s} <= {self.heartbeat_interval_s})",
                field="node_lost_after_s",
            )
        self._check_process_keys()
        _check_optional_addresses(self, ("operator_listen",))

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{Path(self.state_dir) / 'fleetshift.db'}"


@dataclasses.dataclass(frozen=True)
class AgentConfig(ProcessKeys):
    node_name: str = dataclasses.field(default_factory=socket.gethostname)
    listen: str = "127.0.0.1:50052"
    advertise_address: str = ""  # what the daemon dials; empty: the bound listen address
    daemon_address: str = "127.0.0.1:50051"  # or every replica, comma-separated (docs/replicas.md)
    state_dir: str = "/var/lib/fleetshift-agent"
    inventory: str = "auto"  # auto: NVML if present else declared | nvml | declared
    gpus: tuple[DeclaredGpu, ...] = ()
    reconnect_initial_s: float = 0.2
    reconnect_max_s: float = 5.0
    # Workers (the reference engine) this agent starts on the daemon's command.
    worker_compile: bool = True
    worker_threads: int = 0  # torch threads per worker; 0: torch's default
    worker_start_timeout_s: float = 300.0  # StartWorker fails if the worker is not serving by then
    # The address this node's workers listen on and report (docs/multihost.md); empty: the
    # host of advertise_address, else of listen. It must be one the daemon, the other agents
    # and Route's clients can dial, and, under TLS, a SAN of the node's certificate.
    worker_host: str = ""
    # Certificate identities allowed to open sessions on this node's workers, as
    # '<kind>:<name>' or '<kind>:*' (docs/security.md); control calls are never theirs.
    worker_session_callers: tuple[str, ...] = ("router:*",)
    # The interpreter that runs vLLM workers' servers (engine "vllm"); empty: the agent's own.
    # A separate virtualenv keeps vLLM's pins (its torch, its transformers) apart (docs/vllm.md).
    vllm_python: str = ""
    # A warm start loads the snapshot's compiled graphs and kernels: generated code, so only
    # where the snapshot stores are trusted like code (docs/security.md).
    worker_compile_artifacts: bool = False
    # Snapshot retention, applied after every snapshot or fetch; 0 disables a rule. Pinned
    # snapshots and ones a restore or transfer is using are always kept.
    snapshot_keep_last_per_model: int = 0
    snapshot_max_age_s: float = 0.0
    snapshot_max_total_gb: float = 0.0

    def __post_init__(self) -> None:
        _check_address("listen", self.listen)
        for address in split_addresses(self.daemon_address):  # several: daemon replicas
            _check_address("daemon_address", address)
        self._check_process_keys()
        if self.advertise_address:
            _check_address("advertise_address", self.advertise_address)
        if not self.advertise_address and _unspecified(self.listen.rpartition(":")[0]):
            raise ConfigError(
                f"config key 'listen' = {self.listen!r} binds every address, which no peer "
                "can dial: set advertise_address to the address the daemon reaches",
                field="advertise_address",
            )
        if self.worker_host and not _dialable_host(self.worker_host):
            raise ConfigError(
                f"config key 'worker_host' = {self.worker_host!r} must be one address peers "
                "can dial (a host name or IP, without a port)",
                field="worker_host",
            )
        if self.inventory not in ("auto", "nvml", "declared"):
            raise ConfigError(
                "config key 'inventory' must be auto, nvml or declared", field="inventory"
            )
        if self.inventory == "declared" and not self.gpus:
            raise ConfigError(
                "inventory = 'declared' needs at least one [[gpus]] entry", field="gpus"
            )
        for name in ("reconnect_initial_s", "reconnect_max_s", "worker_start_timeout_s"):
            _check_positive(name, getattr(self, name))
        for name in ("snapshot_keep_last_per_model", "snapshot_max_age_s", "snapshot_max_total_gb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config key '{name}' must be >= 0 (0: off)", field=name)

    @property
    def effective_worker_host(self) -> str:
        """Where this node's workers listen and what their endpoints name: ``worker_host``,
        else the host the daemon dials this agent at."""
        if self.worker_host:
            return self.worker_host.strip("[]")
        return (self.advertise_address or self.listen).rpartition(":")[0].strip("[]")


def load_config(cls: type[T], path: str | Path | None, env: Mapping[str, str], prefix: str) -> T:
    """Build ``cls`` from a TOML file (optional) and ``{prefix}{KEY}`` environment overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist", field="config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not valid TOML: {exc}", field="config"
            ) from None
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            raise ConfigError(f"unknown config key '{key}' in {path}", field=key)
    for name in fields:
        env_key = f"{prefix}{name.upper()}"
        if env_key in env:
            raw[name] = _from_env(env_key, env[env_key], hints[name])
    values = {name: _coerce(name, value, hints[name]) for name, value in raw.items()}
    return cls(**values)


def _from_env(env_key: str, text: str, hint: Any) -> Any:
    if _strip_optional(hint) in (str,):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f"environment variable {env_key} is not a valid TOML value: {text!r}", field=env_key
        ) from None


def _strip_optional(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _coerce(name: str, value: Any, hint: Any) -> Any:
    hint = _strip_optional(hint)
    origin = typing.get_origin(hint)
    if origin is tuple:
        (item_type, _) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{name}' must be a list", field=name)
        return tuple(_coerce_item(f"{name}[{i}]", v, item_type) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return _coerce_item(name, value, hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (str, int, float, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(
                f"config key '{name}' must be {hint.__name__}, got {type(value).__name__}",
                field=name,
            )
        return value
    raise ConfigError(f"config key '{name}' has an unsupported type", field=name)


def _coerce_item(name: str, value: Any, item_type: Any) -> Any:
    if dataclasses.is_dataclass(item_type):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{name}' must be a table", field=name)
        hints = typing.get_type_hints(item_type)
        known = {f.name for f in dataclasses.fields(item_type)}
        for key in value:
            if key not in known:
                raise ConfigError(f"unknown config key '{name}.{key}'", field=f"{name}.{key}")
        kwargs = {k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in value.items()}
        try:
            return item_type(**kwargs)  # type: ignore[operator]
        except TypeError as exc:
            raise ConfigError(f"config key '{name}' is incomplete: {exc}", field=name) from None
    return _coerce(name, value, item_type)


def daemon_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> DaemonConfig:
    return load_config(DaemonConfig, path, os.environ if env is None else env, "FLEETSHIFTD_")


def agent_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> AgentConfig:
    return load_config(AgentConfig, path, os.environ if env is None else env, "FLEETSHIFT_AGENT_")

"""The simulated fleet: which GPUs, how they are cut into model instances, and the SLO rule.

A fleet file is TOML so an operator can describe the fleet they own (or consider buying) in a
few lines and replay their own trace on it. Example::

    [model]
    preset = "llama2-70b"        # or "llama31-70b", or hf_config = "path/to/config.json"
    dtype = "bf16"
    # context_window = 4096      # default: the preset's window, or the config's
                                 # max_position_embeddings; longer requests are refused

    [slo]                        # Splitwise convention: multiples of the unloaded times
    ttft_multiple = 6.0
    tbt_multiple = 5.0
    reference_gpu = "A100-SXM-80GB"   # default: the slowest kind in the fleet

    [network]
    internode_gbps_per_gpu = 50.0     # one 400 Gb/s InfiniBand NIC per GPU (DGX)

    [[nodes]]
    gpu = "H100-SXM"
    count = 4                    # identical nodes
    gpus = 8                     # GPUs per node
    tp = 8                       # one instance per 8 GPUs

    [gpus.H100-SXM]              # optional catalogue overrides, e.g. your price
    price_per_hour = 2.5
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.gpus import GpuCatalogue, GpuKind, default_catalogue
from fleetshift_daemon.core.perfmodel import (
    CONTEXT_WINDOWS,
    PRESETS,
    Deployment,
    Dtype,
    ModelArch,
    PerfModel,
)


@dataclass(frozen=True)
class NodeGroup:
    gpu: str
    count: int
    gpus: int
    tp: int


@dataclass(frozen=True)
class SloRule:
    ttft_multiple: float = 6.0
    tbt_multiple: float = 5.0
    reference_gpu: str | None = None


@dataclass(frozen=True)
class SimFleet:
    arch: ModelArch
    dtype: Dtype
    groups: tuple[NodeGroup, ...]
    catalogue: GpuCatalogue = field(default_factory=default_catalogue, compare=False)
    slo: SloRule = SloRule()
    internode_gbps_per_gpu: float = 50.0
    context_window: int | None = None  # tokens (prompt + output); None: no limit known

    def deployment(self, group: NodeGroup) -> Deployment:
        return Deployment(self.arch, self.catalogue.get(group.gpu), group.tp, self.dtype)

    def instance_slots(self) -> list[tuple[int, NodeGroup]]:
        """(node index, group) for every instance, nodes numbered across groups."""
        slots: list[tuple[int, NodeGroup]] = []
        node = 0
        for g in self.groups:
            for _ in range(g.count):
                slots.extend((node, g) for _ in range(g.gpus // g.tp))
                node += 1
        return slots

    def gpu_kinds(self) -> list[GpuKind]:
        seen: dict[str, GpuKind] = {}
        for g in self.groups:
            seen.setdefault(g.gpu, self.catalogue.get(g.gpu))
        return list(seen.values())

    def gpu_count(self, kind: str | None = None) -> int:
        return sum(g.count * g.gpus for g in self.groups if kind is None or g.gpu == kind)

    def price_per_hour(self) -> float:
        return sum(g.count * g.gpus * self.catalogue.get(g.gpu).price_per_hour for g in self.groups)

    def reference_deployment(self, model: PerfModel) -> Deployment:
        """The SLO's reference: the named kind, else the slowest to decode one token unloaded."""
        if self.slo.reference_gpu is not None:
            for g in self.groups:
                if g.gpu == self.slo.reference_gpu:
                    return self.deployment(g)
            gpu = self.catalogue.get(self.slo.reference_gpu)
            return Deployment(self.arch, gpu, self.groups[0].tp, self.dtype)
        deps = [self.deployment(g) for g in self.groups]
        return max(deps, key=lambda d: model.decode_step_time_s(d, 1, 1024))

    def with_groups(self, groups: Sequence[NodeGroup]) -> SimFleet:
        return SimFleet(
            self.arch,
            self.dtype,
            tuple(groups),
            self.catalogue,
            self.slo,
            self.internode_gbps_per_gpu,
            self.context_window,
        )


def _need(data: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise InvalidArgument(f"{where}.{key} is required", field=f"{where}.{key}")
    value = data[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidArgument(f"{where}.{key} must be a {kind.__name__}", field=f"{where}.{key}")
    return value


def fleet_from_mapping(data: Mapping[str, Any], base_dir: Path | None = None) -> SimFleet:
    catalogue = default_catalogue()
    if "gpus" in data:
        catalogue = catalogue.extended(data["gpus"])
    model = data.get("model", {})
    if "hf_config" in model:
        cfg_path = Path(model["hf_config"])
        if base_dir is not None and not cfg_path.is_absolute():
            cfg_path = base_dir / cfg_path
        raw = json.loads(cfg_path.read_text())
        arch = ModelArch.from_hf_config(cfg_path.parent.name, raw)
        window = raw.get("max_position_embeddings")
    else:
        preset = model.get("preset", "llama2-70b")
        if preset not in PRESETS:
            raise InvalidArgument(
                f"model.preset {preset!r} unknown (known: {sorted(PRESETS)})",
                field="model.preset",
            )
        arch = PRESETS[preset]()
        window = CONTEXT_WINDOWS.get(preset)
    window = model.get("context_window", window)
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise InvalidArgument(
            f"model.context_window must be a positive integer, got {window!r}",
            field="model.context_window",
        )
    try:
        dtype = Dtype(model.get("dtype", "bf16"))
    except ValueError:
        raise InvalidArgument(
            f"model.dtype {model.get('dtype')!r} unknown", field="model.dtype"
        ) from None
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise InvalidArgument("at least one [[nodes]] table is required", field="nodes")
    groups = []
    for i, n in enumerate(nodes):
        where = f"nodes[{i}]"
        gpu = _need(n, "gpu", str, where)
        catalogue.get(gpu)
        gpus = int(n.get("gpus", 8))
        tp = int(n.get("tp", gpus))
        count = int(n.get("count", 1))
        if count < 1 or gpus < 1 or tp < 1 or gpus % tp:
            raise InvalidArgument(
                f"{where}: need count>=1, gpus>=1 and tp dividing gpus", field=f"{where}.tp"
            )
        groups.append(NodeGroup(gpu, count, gpus, tp))
    slo_data = data.get("slo", {})
    slo = SloRule(
        float(slo_data.get("ttft_multiple", 6.0)),
        float(slo_data.get("tbt_multiple", 5.0)),
        slo_data.get("reference_gpu"),
    )
    net = float(data.get("network", {}).get("internode_gbps_per_gpu", 50.0))
    fleet = SimFleet(arch, dtype, tuple(groups), catalogue, slo, net, window)
    model_check = PerfModel()
    for g in groups:
        model_check.kv_capacity_tokens(fleet.deployment(g))  # typed error if it does not fit
    return fleet


def load_fleet(path: str | Path) -> SimFleet:
    path = Path(path)
    with path.open("rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"{path}: {exc}", field="fleet") from None
    return fleet_from_mapping(data, path.parent)


def standard_fleet(tp: int = 8, nodes_per_kind: int = 4, preset: str = "llama2-70b") -> SimFleet:
    """The benchmark fleet: 4 DGX-A100 80GB, 4 DGX-H100, 4 DGX-H200, Llama-2-70B by default."""
    groups = tuple(
        NodeGroup(k, nodes_per_kind, 8, tp) for k in ("A100-SXM-80GB", "H100-SXM", "H200-SXM")
    )
    return preset_fleet(preset, groups)


def preset_fleet(preset: str, groups: Sequence[NodeGroup], slo: SloRule | None = None) -> SimFleet:
    """A BF16 fleet of a preset model, with the preset's context window."""
    if preset not in PRESETS:
        raise InvalidArgument(
            f"model preset {preset!r} unknown (known: {sorted(PRESETS)})", field="model"
        )
    return SimFleet(
        PRESETS[preset](),
        Dtype.BF16,
        tuple(groups),
        slo=slo or SloRule(),
        context_window=CONTEXT_WINDOWS[preset],
    )

"""The GPU kinds a fleet may hold, with the published figures the performance model builds on.

Placement decisions hinge on a handful of datasheet numbers (dense tensor throughput, HBM size
and bandwidth, interconnect), so they live in one catalogue that an operator can extend from
config without code: a new GPU kind is a mapping of the same fields. Prices are the operator's
to set; the defaults below are illustrative on-demand figures, not quotes.

NVML product names are matched by substring, longest pattern first, with per-kind exclusions,
so "NVIDIA H100 80GB HBM3" (SXM) and "NVIDIA H100 NVL" / "NVIDIA H100 PCIe" (different memory
bandwidth and power) never collapse into one kind.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.errors import GpuKindNotInCatalogue

GIB = 1 << 30


@dataclass(frozen=True)
class GpuKind:
    """One GPU product as the model sees it. Throughputs are dense (no sparsity)."""

    name: str
    product_patterns: tuple[str, ...]
    bf16_tflops: float
    fp8_tflops: float | None
    int8_tops: float
    hbm_gb: float
    hbm_tbps: float
    nvlink_gbps: float
    tdp_w: float
    price_per_hour: float
    exclude_patterns: tuple[str, ...] = ()
    pcie_gbps: float = 64.0
    # A CPU kind's cache private to one core (its L2), MiB: weights larger than this are read
    # from memory again by every chunk of rows the reference engine multiplies. 0: not known,
    # nothing is taken to stay cached. GPU kinds: unused.
    core_cache_mb: float = 0.0

    @property
    def hbm_bytes(self) -> int:
        """Memory as marketed ("80 GB") is read as GiB, which is what the devices expose."""
        return int(self.hbm_gb * GIB)

    @property
    def interconnect_gbps(self) -> float:
        """Bandwidth (GB/s, bidirectional) a TP group communicates over: NVLink, else PCIe."""
        return self.nvlink_gbps if self.nvlink_gbps > 0 else self.pcie_gbps

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_tflops is not None

    def matches_product(self, product_name: str) -> int:
        """Length of the longest pattern found in ``product_name``; 0 when it is not this kind."""
        lowered = product_name.lower()
        if any(ex.lower() in lowered for ex in self.exclude_patterns):
            return 0
        return max((len(p) for p in self.product_patterns if p.lower() in lowered), default=0)


PRODUCT_CACHE = 4096  # distinct product names remembered by a catalogue

_POSITIVE_FIELDS = ("bf16_tflops", "int8_tops", "hbm_gb", "hbm_tbps", "tdp_w")
_NON_NEGATIVE_FIELDS = ("nvlink_gbps", "price_per_hour", "pcie_gbps", "core_cache_mb")


def _validate(kind: GpuKind, where: str) -> GpuKind:
    if not kind.name:
        raise InvalidArgument(f"{where}.name must not be empty", field=f"{where}.name")
    for f in _POSITIVE_FIELDS:
        value = getattr(kind, f)
        if not (math.isfinite(value) and value > 0):
            raise InvalidArgument(f"{where}.{f} must be > 0, got {value!r}", field=f"{where}.{f}")
    for f in _NON_NEGATIVE_FIELDS:
        value = getattr(kind, f)
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgument(f"{where}.{f} must be >= 0, got {value!r}", field=f"{where}.{f}")
    if kind.fp8_tflops is not None and not kind.fp8_tflops > 0:
        raise InvalidArgument(
            f"{where}.fp8_tflops must be > 0 or absent, got {kind.fp8_tflops!r}",
            field=f"{where}.fp8_tflops",
        )
    if kind.nvlink_gbps <= 0 and kind.pcie_gbps <= 0:
        raise InvalidArgument(
            f"{where} needs nvlink_gbps or pcie_gbps > 0", field=f"{where}.pcie_gbps"
        )
    return kind


_FIELD_TYPES: dict[str, type] = {
    f.name: (str if f.name == "name" else tuple if "patterns" in f.name else float)
    for f in dataclasses.fields(GpuKind)
}


def gpu_kind_from_mapping(data: Mapping[str, Any], where: str = "gpu") -> GpuKind:
    """Build a kind from config; every error names the offending key (``where.key``)."""
    unknown = sorted(set(data) - set(_FIELD_TYPES))
    if unknown:
        raise InvalidArgument(f"{where}.{unknown[0]}: unknown key", field=f"{where}.{unknown[0]}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GpuKind):
        has_default = f.default is not dataclasses.MISSING
        if f.name not in data:
            if f.name == "fp8_tflops":
                values[f.name] = None
                continue
            if has_default:
                continue
            raise InvalidArgument(f"{where}.{f.name} is required", field=f"{where}.{f.name}")
        raw = data[f.name]
        values[f.name] = _coerce(raw, f.name, where)
    return _validate(GpuKind(**values), where)


def _coerce(raw: Any, key: str, where: str) -> Any:
    expected = _FIELD_TYPES[key]
    field = f"{where}.{key}"
    if expected is str:
        if not isinstance(raw, str):
            raise InvalidArgument(f"{field} must be a string", field=field)
        return raw
    if expected is tuple:
        if isinstance(raw, str) or not isinstance(raw, Iterable):
            raise InvalidArgument(f"{field} must be a list of strings", field=field)
        items = tuple(raw)
        if not all(isinstance(p, str) and p for p in items):
            raise InvalidArgument(f"{field} must be a list of non-empty strings", field=field)
        return items
    if raw is None and key == "fp8_tflops":
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise InvalidArgument(f"{field} must be a number, got {raw!r}", field=field)
    return float(raw)


class GpuCatalogue:
    """The GPU kinds known to this daemon, looked up by kind name or NVML product name."""

    def __init__(self, kinds: Iterable[GpuKind]) -> None:
        self._by_name: dict[str, GpuKind] = {}
        for kind in kinds:
            _validate(kind, f"gpu[{kind.name}]")
            if kind.name in self._by_name:
                raise InvalidArgument(
                    f"gpu kind {kind.name!r} declared twice", field=f"gpu[{kind.name}].name"
                )
            self._by_name[kind.name] = kind
        self._by_product: dict[str, GpuKind | None] = {}

    def get(self, name: str) -> GpuKind:
        try:
            return self._by_name[name]
        except KeyError:
            raise GpuKindNotInCatalogue(
                f"gpu kind {name!r} is not in the catalogue (known: {sorted(self._by_name)})",
                field="gpu_kind",
            ) from None

    def for_product(self, product_name: str) -> GpuKind | None:
        """The kind whose pattern matches ``product_name`` longest. Remembered per product
        name (a catalogue never changes; ``extended`` makes a new one): the daemon asks for
        every GPU of the fleet on each liveness sweep and index rebuild, and matching every
        pattern of every kind took most of a loaded core at 1,000 nodes (8,000 GPUs)."""
        try:
            return self._by_product[product_name]
        except KeyError:
            pass
        best = self._match(product_name)
        if len(self._by_product) < PRODUCT_CACHE:  # names come from agents: bounded memory
            self._by_product[product_name] = best
        return best

    def _match(self, product_name: str) -> GpuKind | None:
        best: GpuKind | None = None
        best_len = 0
        for kind in self._by_name.values():
            n = kind.matches_product(product_name)
            if n > best_len:
                best, best_len = kind, n
        return best

    def kinds(self) -> tuple[GpuKind, ...]:
        return tuple(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def extended(self, config: Mapping[str, Mapping[str, Any]]) -> GpuCatalogue:
        """A new catalogue with ``config`` (kind name -> fields) added or overriding kinds.

        A key that names a known kind may give only the fields it changes (e.g. a price).
        """
        kinds = dict(self._by_name)
        for name, fields in config.items():
            where = f"gpus.{name}"
            if not isinstance(fields, Mapping):
                raise InvalidArgument(f"{where} must be a mapping", field=where)
            merged: dict[str, Any] = {}
            if name in kinds:
                merged = dataclasses.asdict(kinds[name])
            merged.update(fields)
            merged.setdefault("name", name)
            if merged["name"] != name:
                raise InvalidArgument(f"{where}.name must equal the key {name!r}", field=where)
            kinds[name] = gpu_kind_from_mapping(merged, where)
        return GpuCatalogue(kinds.values())


A100_SXM_80GB = GpuKind(
    name="A100-SXM-80GB",
    product_patterns=("A100-SXM4-80GB", "A100-SXM-80GB"),
    exclude_patterns=("PCIe",),
    bf16_tflops=312.0,
    fp8_tflops=None,
    int8_tops=624.0,
    hbm_gb=80.0,
    hbm_tbps=2.0,
    nvlink_gbps=600.0,
    tdp_w=400.0,
    price_per_hour=1.80,
)
H100_SXM = GpuKind(
    name="H100-SXM",
    product_patterns=("H100 80GB HBM3", "H100-SXM", "H100 SXM"),
    exclude_patterns=("PCIe", "NVL"),
    bf16_tflops=989.0,
    fp8_tflops=1979.0,
    int8_tops=1979.0,
    hbm_gb=80.0,
    hbm_tbps=3.35,
    nvlink_gbps=900.0,
    tdp_w=700.0,
    price_per_hour=3.00,
)
H200_SXM = GpuKind(
    name="H200-SXM",
    product_patterns=("H200",),
    exclude_patterns=("NVL", "PCIe"),
    bf16_tflops=989.0,
    fp8_tflops=1979.0,
    int8_tops=1979.0,
    hbm_gb=141.0,
    hbm_tbps=4.8,
    nvlink_gbps=900.0,
    tdp_w=700.0,
    price_per_hour=3.80,
)
# L40S datasheet gives 362.05 BF16 / 733 FP8 / 733 INT8 *with sparsity*; dense is half.
# No NVLink: a TP group talks over PCIe Gen4 x16 (64 GB/s bidirectional).
L40S = GpuKind(
    name="L40S",
    product_patterns=("L40S",),
    bf16_tflops=181.0,
    fp8_tflops=366.0,
    int8_tops=366.0,
    hbm_gb=48.0,
    hbm_tbps=0.864,
    nvlink_gbps=0.0,
    tdp_w=350.0,
    price_per_hour=1.00,
    pcie_gbps=64.0,
)


def default_catalogue() -> GpuCatalogue:
    """Published figures (NVIDIA product pages; H200's marked preliminary there)."""
    return GpuCatalogue((A100_SXM_80GB, H100_SXM, H200_SXM, L40S))


# The power-capped (70 % of TDP) DGX-H100 of the Splitwise measurements. NVML cannot tell it
# from an uncapped H100, so it matches no product name; an operator declares it. Its model is
# H100's with one fitted compute_scale (see perf_factors.SHIPPED_FACTORS).
H100_SXM_PCAP70 = dataclasses.replace(
    H100_SXM, name="H100-SXM-PCAP70", product_patterns=(), exclude_patterns=(), tdp_w=490.0
)

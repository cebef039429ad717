"""What GPUs this node has: read through NVML, or taken from the agent's config.

A machine without NVML (a laptop, CI, a CPU-only demo node) still runs an agent so the whole
system can be exercised; its inventory is marked *declared* all the way to the operator's
table, so nobody mistakes a declared H200 for a discovered one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata

from fleetshift_common.config import AgentConfig, DeclaredGpu
from fleetshift_common.errors import FailedPrecondition
from fleetshift_common.gpu_products import GiB, bandwidth_class_for, find_product

log = logging.getLogger("fleetshift.agent.discovery")

NVML = "nvml"
DECLARED = "declared"


@dataclass(frozen=True)
class GpuFacts:
    index: int
    product_name: str
    memory_bytes: int
    bandwidth_class: str
    compute_capability: str
    fp8_supported: bool
    nvlink_peers: tuple[int, ...] = ()
    uuid: str = ""


@dataclass(frozen=True)
class Inventory:
    source: str  # NVML or DECLARED
    gpus: tuple[GpuFacts, ...]
    driver_version: str = ""
    cuda_version: str = ""


class NvmlUnavailable(FailedPrecondition):
    pass


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def discover(config: AgentConfig) -> Inventory:
    if config.inventory == "declared":
        return declared_inventory(config.gpus)
    try:
        return nvml_inventory()
    except NvmlUnavailable as err:
        if config.inventory == "nvml" or not config.gpus:
            raise
        log.warning("NVML unavailable (%s); using the inventory declared in the config", err)
        return declared_inventory(config.gpus)


def declared_inventory(declared: tuple[DeclaredGpu, ...]) -> Inventory:
    gpus: list[GpuFacts] = []
    for entry in declared:
        product = find_product(entry.product_name)
        first = len(gpus)
        for _ in range(entry.count):
            index = len(gpus)
            linked = entry.nvlink if entry.nvlink is not None else bool(product and product.nvlink)
            peers = tuple(i for i in range(first, first + entry.count) if i != index and linked)
            memory = (
                int(entry.memory_gb * GiB)
                if entry.memory_gb is not None
                else (product.memory_bytes if product else 0)
            )
            cc = entry.compute_capability or (product.compute_capability if product else "")
            gpus.append(
                GpuFacts(
                    index=index,
                    product_name=product.product_name if product else entry.product_name,
                    memory_bytes=memory,
                    bandwidth_class=product.bandwidth_class if product else "unknown",
                    compute_capability=cc,
                    fp8_supported=product.fp8_supported if product else False,
                    nvlink_peers=peers,
                )
            )
    return Inventory(source=DECLARED, gpus=tuple(gpus))


def nvml_inventory() -> Inventory:
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NvmlUnavailable(f"pynvml is not installed: {err}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"nvmlInit failed: {err}") from None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda_int = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        cuda = f"{cuda_int // 1000}.{(cuda_int % 1000) // 10}"
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        bus_to_index = {
            _text(pynvml.nvmlDeviceGetPciInfo(h).busId).lower(): i for i, h in enumerate(handles)
        }
        gpus = tuple(_nvml_gpu(pynvml, i, h, bus_to_index) for i, h in enumerate(handles))
        return Inventory(source=NVML, gpus=gpus, driver_version=driver, cuda_version=cuda)
    finally:
        pynvml.nvmlShutdown()


def _nvml_gpu(pynvml: object, index: int, handle: object, bus_to_index: dict[str, int]) -> GpuFacts:
    nv = pynvml
    name = _text(nv.nvmlDeviceGetName(handle))  # type: ignore[attr-defined]
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)  # type: ignore[attr-defined]
    cc = f"{major}.{minor}"
    product = find_product(name)
    return GpuFacts(
        index=index,
        product_name=name,
        memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(handle).total),  # type: ignore[attr-defined]
        bandwidth_class=product.bandwidth_class if product else bandwidth_class_for("", cc),
        compute_capability=cc,
        fp8_supported=(major, minor) >= (8, 9),
        nvlink_peers=_nvlink_peers(nv, handle, index, bus_to_index),
        uuid=_text(nv.nvmlDeviceGetUUID(handle)),  # type: ignore[attr-defined]
    )


def _nvlink_peers(
    nv: object, handle: object, index: int, bus_to_index: dict[str, int]
) -> tuple[int, ...]:
    peers: set[int] = set()
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if not nv.nvmlDeviceGetNvLinkState(handle, link):  # type: ignore[attr-defined]
                continue
            remote = nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)  # type: ignore[attr-defined]
        except Exception:  # links past the device's count, or NVLink not supported
            continue
        peer = bus_to_index.get(_text(remote.busId).lower())
        if peer is not None and peer != index:
            peers.add(peer)
    return tuple(sorted(peers))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

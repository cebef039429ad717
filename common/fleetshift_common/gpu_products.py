"""Hardware facts of the GPU products FleetShift knows by their NVML names.

An agent without NVML (a CPU test box, a demo) declares its GPUs by product name only; this
table fills in what NVML would have reported, so a declared H100 registers with the same memory,
compute capability and FP8 flag as a discovered one. Figures: NVIDIA product pages.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class GpuProduct:
    product_name: str
    memory_bytes: int
    bandwidth_class: str
    compute_capability: str
    fp8_supported: bool
    nvlink: bool


KNOWN_PRODUCTS: tuple[GpuProduct, ...] = (
    GpuProduct("NVIDIA A100-SXM4-80GB", 80 * GiB, "hbm2e", "8.0", False, True),
    GpuProduct("NVIDIA A100-SXM4-40GB", 40 * GiB, "hbm2", "8.0", False, True),
    GpuProduct("NVIDIA H100 80GB HBM3", 80 * GiB, "hbm3", "9.0", True, True),
    GpuProduct("NVIDIA H100 NVL", 94 * GiB, "hbm3", "9.0", True, True),
    GpuProduct("NVIDIA H200", 141 * GiB, "hbm3e", "9.0", True, True),
    GpuProduct("NVIDIA L40S", 48 * GiB, "gddr6", "8.9", True, False),
)


def find_product(product_name: str) -> GpuProduct | None:
    """Exact NVML name first, then a unique case-insensitive substring match ("H200")."""
    wanted = product_name.strip().lower()
    for product in KNOWN_PRODUCTS:
        if product.product_name.lower() == wanted:
            return product
    matches = [p for p in KNOWN_PRODUCTS if wanted and wanted in p.product_name.lower()]
    return matches[0] if len(matches) == 1 else None


def bandwidth_class_for(memory_type_hint: str, compute_capability: str) -> str:
    """Best guess of the memory technology when NVML names a product this table lacks."""
    if memory_type_hint:
        return memory_type_hint
    major = compute_capability.split(".", 1)[0]
    return {"8": "hbm2e", "9": "hbm3", "10": "hbm3e"}.get(major, "unknown")

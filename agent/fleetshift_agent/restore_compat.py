"""What a restore on this node keeps and what it recomputes, said to the caller (issue 13 item 11).

A snapshot whose key differs from the destination's (another GPU product, another torch) still
restores: the weights are the snapshot's own, the KV is recomputed. That used to be visible in
the worker's log only. Two answers come from here:

- the StartWorker reply of a worker started from a snapshot carries the verdict of the restore
  that happened (the snapshot's key against the started worker's own key);
- CheckCompatibility can be asked about *this node* by name, instead of with a full destination
  key: the destination is the key this node's workers report (its first GPU's product, marked
  "(declared)" on a declared inventory exactly as its workers mark it; its driver and CUDA on
  NVML; this agent's torch and engine), with the snapshot's own model fields, since a restore
  always loads the snapshot's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fleetshift_agent.discovery import DECLARED, Inventory
from fleetshift_agent.engine import ENGINE_NAME, ENGINE_VERSION
from fleetshift_common.compat import CompatKey, CompatVerdict


@dataclass(frozen=True)
class NodePlatform:
    node_name: str
    gpu_product: str
    compute_capability: str
    driver_version: str
    cuda_version: str

    @classmethod
    def of(cls, node_name: str, inventory: Inventory) -> NodePlatform:
        gpu = min(inventory.gpus, key=lambda g: g.index)
        if inventory.source == DECLARED:  # CPU workers stand in for the declared product
            return cls(node_name, f"{gpu.product_name} (declared)", "none", "none", "none")
        return cls(
            node_name,
            gpu.product_name,
            gpu.compute_capability,
            inventory.driver_version,
            inventory.cuda_version,
        )

    def destination(self, snapshot: CompatKey) -> CompatKey:
        """The key a worker restored here from ``snapshot`` would have."""
        return replace(
            snapshot,
            gpu_product=self.gpu_product,
            gpu_count=1,
            compute_capability=self.compute_capability,
            driver_version=self.driver_version,
            cuda_version=self.cuda_version,
            torch_version=torch.__version__,
            engine_name=ENGINE_NAME,
            engine_version=ENGINE_VERSION,
        )


def restore_note(verdict: CompatVerdict) -> str:
    """One sentence for the StartWorker reply: what the restore kept."""
    if verdict.warm_ok:
        return "warm restore: every field of the key matches (weights, compiled graphs, KV)"
    kept = "weights kept, KV recomputed" if verdict.weights_reusable else "weights NOT reusable"
    return f"{kept}: {verdict.describe()}"

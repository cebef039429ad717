"""The inference engines a model can be served by, and which tensor-parallel sizes each runs.

The planner sizes workers at tensor-parallel 1/2/4/8 from the performance model, but whether a
worker of that shape really shards over that many devices is the engine's to say. The
reference engine computes on one device (its snapshot key records ``gpu_count`` 1 and
``tensor_parallel`` 1): on real GPUs a TP-2 reference worker would hold two GPUs and use one.
This table is the one place that says so; a model's ``engine`` key (default ``reference``)
names its row, and the daemon refuses, or labels, the shapes an engine does not run. An engine
added beside the reference one (vLLM) adds its row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

REFERENCE = "reference"
VLLM = "vllm"


@dataclass(frozen=True)
class EngineTraits:
    name: str
    # Tensor-parallel sizes a worker of this engine really shards over that many devices.
    real_tp: tuple[int, ...]
    # What a worker of this engine computes on, for messages ("one device").
    computes_on: str


ENGINES: Mapping[str, EngineTraits] = {
    REFERENCE: EngineTraits(REFERENCE, real_tp=(1,), computes_on="one device"),
    # vLLM shards tensor parallel itself on real GPUs (docs/vllm.md); on a declared (CPU)
    # inventory the agent runs a vLLM worker as one rank and refuses a larger TP by name.
    VLLM: EngineTraits(VLLM, real_tp=(1, 2, 4, 8), computes_on="its tensor-parallel GPUs"),
}


def engine_traits(name: str) -> EngineTraits:
    """The engine's row; ``KeyError`` for a name no row has (config validation refuses it)."""
    return ENGINES[name]


def runs_tp(engine: str, tp: int) -> bool:
    """Whether a worker of ``engine`` at ``tp`` really computes on ``tp`` devices."""
    return tp in engine_traits(engine).real_tp

"""The reference inference engine: a small, real, bit-reproducible Llama-style engine.

It is the engine FleetShift's snapshots are proven on: a session checkpointed mid-generation
and restored elsewhere produces exactly the tokens it would have produced uninterrupted.
"""

from fleetshift_agent.engine.config import ENGINE_NAME, ENGINE_VERSION, EngineConfig, ModelConfig
from fleetshift_agent.engine.engine import Counters, Engine, TokenEvent
from fleetshift_agent.engine.sampling import SamplingParams
from fleetshift_agent.engine.session import Session, SessionExport, SessionState

__all__ = [
    "ENGINE_NAME",
    "ENGINE_VERSION",
    "Counters",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "Session",
    "SessionExport",
    "SessionState",
    "TokenEvent",
]

"""Which engines this agent can run a worker with, and the command that starts each.

A model's config names its engine (``reference``, the default, or ``vllm``) and that engine's
arguments; the daemon passes both in StartWorker. Every engine's worker serves the same
``WorkerService`` and writes the same port file, so the supervisor, the daemon, the router and
the executor never need to know which one runs. An engine this agent does not know is
INVALID_ARGUMENT naming it; one it knows but cannot run here (no vLLM importable by the
configured ``vllm_python``) is FAILED_PRECONDITION saying what to install; both before any
process is spawned.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from fleetshift_common.config import ConfigError, EngineArgs
from fleetshift_common.engines import ENGINES
from fleetshift_common.errors import FailedPrecondition, InvalidArgument

REFERENCE, VLLM = "reference", "vllm"
_PROBE = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
NO_SNAPSHOT_NOTE = (
    "vllm: no checkpoint/restore on this host (vLLM's needs CRIU and cuda-checkpoint); "
    "a move starts the target fresh and carries sessions as token history"
)


@dataclass
class EngineSupport:
    """What this node can run; vLLM is probed once (a subprocess, ~0.1 s), then cached."""

    vllm_python: str = ""  # empty: this agent's own interpreter
    _vllm_missing: str | None = field(default=None, init=False)

    @property
    def python(self) -> str:
        return self.vllm_python or sys.executable

    def vllm_missing(self) -> str:
        """Why vLLM cannot run here ("" when it can)."""
        if self._vllm_missing is None:
            self._vllm_missing = _probe(self.python)
        return self._vllm_missing

    def names(self) -> list[str]:
        return [REFERENCE] + ([] if self.vllm_missing() else [VLLM])

    def notes(self) -> list[str]:
        return [NO_SNAPSHOT_NOTE] if not self.vllm_missing() else [f"vllm: {self.vllm_missing()}"]

    def check(self, engine: str, args_json: str) -> EngineArgs:
        """The launch's engine arguments, or a refusal naming what is wrong."""
        if engine not in ENGINES:
            raise InvalidArgument(
                f"engine {engine!r} is not known to this agent; it runs "
                f"{', '.join(sorted(ENGINES))}",
                field="engine",
            )
        try:
            args = EngineArgs.from_json(args_json)
        except ConfigError as err:
            raise InvalidArgument(
                f"engine_args_json: {err.message}", field="engine_args_json"
            ) from None
        if engine == VLLM and self.vllm_missing():
            raise FailedPrecondition(
                f"engine 'vllm' cannot run on this node: {self.vllm_missing()}", field="engine"
            )
        return args


def _probe(python: str) -> str:
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"vllm_python {python!r} cannot be run ({err})"
    if done.returncode:
        return (
            f"vllm_python {python!r} cannot import vllm (install fleetshift[vllm] there, or set "
            "the agent's vllm_python to an interpreter that has it)"
        )
    return ""

"""Step times for the simulator, taken from the daemon's own performance model.

The simulator must be timed by the same ``PerfModel`` that places workers, or a good result
would only prove that two models agree with themselves. Calling the model once per decode step
of every instance would cost millions of Python calls for an hour of traffic, so a run of ``k``
decode steps over a fixed batch is evaluated as a piecewise-linear function of the summed
context: the model is probed at the ends and the middle of the run and the range is split only
where it is not linear (a roofline is a max of affine pieces, so a few probes suffice). The
answer matches calling the model for every step to within ``_REL_TOL``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from fleetshift_daemon.core.perfmodel import Deployment, PerfModel
from fleetshift_daemon.sim.trace import FloatArray

_REL_TOL = 1e-6
_MAX_DEPTH = 12


class StepTimer:
    """Prefill and decode times of one deployment, with the caches the simulator needs."""

    def __init__(self, model: PerfModel, dep: Deployment) -> None:
        self.model = model
        self.dep = dep
        self._single_prefill = lru_cache(maxsize=65536)(self._prefill_one)
        self._step = lru_cache(maxsize=262144)(self._decode_one)

    def _prefill_one(self, prompt: int) -> float:
        return self.model.prefill_time_s(self.dep, [prompt])

    def _decode_one(self, batch: int, context: int) -> float:
        return self.model.decode_step_time_s(self.dep, batch, context)

    def prefill_s(self, prompts: Sequence[int]) -> float:
        if len(prompts) == 1:
            return self._single_prefill(int(prompts[0]))
        return self.model.prefill_time_s(self.dep, [int(p) for p in prompts])

    def decode_step_s(self, batch: int, context: int) -> float:
        return self._step(int(batch), int(context))

    def decode_run_s(self, batch: int, context0: int, steps: int) -> FloatArray:
        """Times of ``steps`` decode steps; step ``i`` sees ``context0 + batch * i`` tokens."""
        out = np.empty(steps, dtype=np.float64)
        self._fill(out, 0, steps - 1, batch, context0, 0)
        return out

    def _fill(self, out: FloatArray, i0: int, i1: int, b: int, c0: int, depth: int) -> None:
        t0 = self.decode_step_s(b, c0 + b * i0)
        if i1 == i0:
            out[i0] = t0
            return
        t1 = self.decode_step_s(b, c0 + b * i1)
        if i1 - i0 == 1:
            out[i0], out[i1] = t0, t1
            return
        im = (i0 + i1) // 2
        tm = self.decode_step_s(b, c0 + b * im)
        linear = t0 + (t1 - t0) * (im - i0) / (i1 - i0)
        if depth >= _MAX_DEPTH or abs(tm - linear) <= _REL_TOL * max(tm, 1e-12):
            out[i0 : i1 + 1] = np.linspace(t0, t1, i1 - i0 + 1)
            return
        self._fill(out, i0, im, b, c0, depth + 1)
        self._fill(out, im, i1, b, c0, depth + 1)

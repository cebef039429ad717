"""Online correction of the performance model from what workers actually measure.

The calibrated model is fitted once on one model and one serving stack; a fleet runs others.
Workers report their real step times, so the model keeps one observed/predicted ratio per
(GPU kind, phase), smoothed so a noisy step cannot swing placement, and bounded so a broken
counter cannot make a GPU look ten times faster than its datasheet allows.
"""

from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass

from fleetshift_common.errors import InvalidArgument


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class CorrectionConfig:
    alpha: float = 0.1  # EWMA weight of each new observation
    min_ratio: float = 0.5
    max_ratio: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise InvalidArgument("alpha must be in (0, 1]", field="alpha")
        if not 0.0 < self.min_ratio <= 1.0 <= self.max_ratio:
            raise InvalidArgument("need 0 < min_ratio <= 1 <= max_ratio", field="min_ratio")


class CorrectionTable:
    """Multiplicative time corrections per (GPU kind name, phase); 1.0 until observed."""

    def __init__(self, config: CorrectionConfig | None = None) -> None:
        self._config = config or CorrectionConfig()
        self._ratios: dict[tuple[str, Phase], float] = {}
        self._counts: dict[tuple[str, Phase], int] = {}
        self._lock = threading.Lock()

    def observe(self, gpu_kind: str, phase: Phase, observed_s: float, predicted_s: float) -> float:
        """Fold one observation in; returns the new factor. Non-positive inputs are rejected."""
        if not (math.isfinite(observed_s) and observed_s > 0):
            raise InvalidArgument("observed time must be > 0", field="observed_s")
        if not (math.isfinite(predicted_s) and predicted_s > 0):
            raise InvalidArgument("predicted time must be > 0", field="predicted_s")
        cfg = self._config
        ratio = min(max(observed_s / predicted_s, cfg.min_ratio), cfg.max_ratio)
        key = (gpu_kind, phase)
        with self._lock:
            old = self._ratios.get(key)
            # Smooth in log space so 0.5x and 2x pull equally hard.
            new = (
                ratio
                if old is None
                else math.exp((1 - cfg.alpha) * math.log(old) + cfg.alpha * math.log(ratio))
            )
            new = min(max(new, cfg.min_ratio), cfg.max_ratio)
            self._ratios[key] = new
            self._counts[key] = self._counts.get(key, 0) + 1
        return new

    def factor(self, gpu_kind: str, phase: Phase) -> float:
        return self._ratios.get((gpu_kind, phase), 1.0)

    def observations(self, gpu_kind: str, phase: Phase) -> int:
        return self._counts.get((gpu_kind, phase), 0)

    def snapshot(self) -> dict[tuple[str, Phase], float]:
        with self._lock:
            return dict(self._ratios)

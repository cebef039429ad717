"""A clock the test moves by hand, for code that takes its clock as an argument.

Rates, holds, retention and heartbeat ages are all read from an injected clock; a test that
sets the time itself gets the same answer on a loaded CI runner as on an idle laptop.
"""

from __future__ import annotations


class ManualClock:
    """Stands still until the test sets ``t`` or calls ``advance``."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

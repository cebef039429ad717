"""The demo's traffic: a slice of a real trace, its mix turned from prompt-heavy to
decode-heavy halfway, thinned and time-compressed to what this machine can serve.

Arrival times come from the trace (compressed in time, then thinned by a seeded draw);
request shapes are redrawn per half from the slice's own prompt-heavy and decode-heavy
requests (``sim.trace.shifting_mix``); a request longer than the model's context is left out
and counted, as a server would refuse it. Prompts are seeded token ids of exactly the
trace's length (the OpenAI API takes a prompt as a token array), so the gateway counts what
the trace says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetshift_daemon.sim.trace import Phase, Shape, fit_context, load_trace, shifting_mix

PROMPT_HEAVY, DECODE_HEAVY = "prompt-heavy", "decode-heavy"
CARRIER = "carrier"  # a long stream kept open while a move runs (``demo.carriers``)
SETTLING = "settling"  # the second half's shapes sent after the replay (``demo.settle``)
FIRST_PLAIN_TOKEN = 300  # past the byte tokens and the special tokens of make_model's tokenizer


@dataclass(frozen=True)
class DemoRequest:
    index: int
    at_s: float  # when to send it, from the start of the replay
    prompt: list[int]
    max_tokens: int
    seed: int
    phase: str


@dataclass(frozen=True)
class Workload:
    requests: list[DemoRequest]
    duration_s: float
    turn_at_s: float  # where the mix turns decode-heavy
    left_out: int  # requests over the model's context
    description: str

    def in_phase(self, phase: str) -> list[DemoRequest]:
        return [r for r in self.requests if r.phase == phase]


@dataclass(frozen=True)
class WorkloadSpec:
    trace: Path
    duration_s: float  # replay length
    compress: float  # real seconds of trace per replay second
    rate_per_s: float  # requests per replay second to keep (the rest are thinned out)
    prompt_scale: float  # prompt lengths are multiplied by this
    output_scale: float  # and output lengths by this
    start_s: float = 0.0  # where the slice begins in the trace
    seed: int = 7


def build_workload(spec: WorkloadSpec, context_tokens: int, vocab_size: int) -> Workload:
    """The replay's requests; a clear ValueError when the slice holds nothing to replay."""
    real_span = spec.duration_s * spec.compress
    whole = load_trace(spec.trace)
    piece = whole.window(spec.start_s, spec.start_s + real_span).shifted(-spec.start_s)
    if len(piece) < 4:
        raise ValueError(
            f"{spec.trace}: only {len(piece)} requests between {spec.start_s:.0f} s and "
            f"{spec.start_s + real_span:.0f} s; pick another --trace-start or a longer slice"
        )
    ps, os_ = spec.prompt_scale, spec.output_scale
    halves = [
        Phase(0.5, Shape.PREFILL_HEAVY, ps, os_),
        Phase(0.5, Shape.DECODE_HEAVY, ps, os_),
    ]
    mixed = shifting_mix(piece, halves, spec.seed)
    keep = min(1.0, spec.rate_per_s * spec.duration_s / len(mixed))
    thinned = mixed.rate_scaled(keep, spec.seed) if keep < 1.0 else mixed
    fitted = fit_context(thinned, context_tokens)
    replay = fitted.trace.time_compressed(spec.compress)
    turn_at = piece.duration_s * 0.5 / spec.compress
    rng = np.random.default_rng(spec.seed)
    requests = []
    for i in range(len(replay)):
        at = float(replay.arrival_s[i])
        prompt = rng.integers(FIRST_PLAIN_TOKEN, vocab_size, int(replay.prompt_tokens[i]))
        requests.append(
            DemoRequest(
                index=i,
                at_s=at,
                prompt=[int(t) for t in prompt],
                max_tokens=int(replay.output_tokens[i]),
                seed=1000 + i,
                phase=PROMPT_HEAVY if at < turn_at else DECODE_HEAVY,
            )
        )
    described = (
        f"{spec.trace.name}, {spec.start_s / 60:.0f}-{(spec.start_s + real_span) / 60:.0f} min "
        f"of the trace ({len(piece)} requests) compressed {spec.compress:g}x in time and thinned "
        f"to 1 in {1 / keep:.0f}"
        + (f", prompts x{ps:g}, outputs x{os_:g}" if (ps, os_) != (1, 1) else "")
        + f"; {len(requests)} requests over {spec.duration_s:.0f} s"
        + (
            f" ({fitted.refused} left out: over the {context_tokens}-token context)"
            if fitted.refused
            else ""
        )
    )
    return Workload(requests, spec.duration_s, turn_at, fitted.refused, described)

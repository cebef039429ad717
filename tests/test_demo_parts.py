"""The demo's parts that need no fleet: the workload it replays, the checks it reports, and
the live view at 80 columns."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as opb
from fleetshift_daemon.demo.carriers import Carriers
from fleetshift_daemon.demo.carriers import _targets as operator_targets
from fleetshift_daemon.demo.replay import StreamRecord
from fleetshift_daemon.demo.report import summary_lines
from fleetshift_daemon.demo.settle import Outcome, outcome, settling_request, why_not
from fleetshift_daemon.demo.verify import Verdict, count_check, crossed_a_move
from fleetshift_daemon.demo.view import render, status_line
from fleetshift_daemon.demo.watch import FleetWatch, Sample, Step, recovered_at
from fleetshift_daemon.demo.workload import (
    DECODE_HEAVY,
    PROMPT_HEAVY,
    SETTLING,
    DemoRequest,
    Workload,
    WorkloadSpec,
    build_workload,
)
from fleetshift_daemon.localfleet import NodeSpec

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_conv.csv"


@pytest.mark.skipif(not TRACE.is_file(), reason=f"the shared trace {TRACE} is not here")
def test_the_workload_turns_decode_heavy_halfway_and_fits_the_model() -> None:
    spec = WorkloadSpec(TRACE, 120.0, 4.0, 2.0, 0.25, 0.25)
    w = build_workload(spec, context_tokens=512, vocab_size=512)
    assert 150 < len(w.requests) < 330 and w.turn_at_s == pytest.approx(60, abs=1)
    first, second = w.in_phase(PROMPT_HEAVY), w.in_phase(DECODE_HEAVY)
    assert first and second and all(r.at_s < w.turn_at_s for r in first)
    ratio = [np.mean([len(r.prompt) / r.max_tokens for r in half]) for half in (first, second)]
    assert ratio[0] > 2 * ratio[1]  # prompt-heavy, then decode-heavy
    for r in w.requests:
        assert len(r.prompt) + r.max_tokens <= 512 and all(300 <= t < 512 for t in r.prompt)
    assert "left out" in w.description if w.left_out else True
    again = build_workload(spec, context_tokens=512, vocab_size=512)
    assert [r.prompt for r in again.requests] == [r.prompt for r in w.requests]  # seeded


def test_a_slice_with_nothing_in_it_is_refused_clearly() -> None:
    if not TRACE.is_file():
        pytest.skip("no trace")
    with pytest.raises(ValueError, match="pick another --trace-start"):
        build_workload(WorkloadSpec(TRACE, 10.0, 1.0, 1.0, 1.0, 1.0, 1e9), 512, 512)


def record(
    index: int, asked: int, chunks: int, sent: float, usage: int | None = None
) -> StreamRecord:
    r = StreamRecord(DemoRequest(index, sent, [300], asked, 1, PROMPT_HEAVY), sent_at=sent)
    r.texts = ["x"] * chunks
    r.chunk_at = [sent + 0.1 * i for i in range(chunks)]
    r.usage_tokens = chunks if usage is None else usage
    r.finish_reason = "length"
    r.done = True
    return r


def test_the_count_check_catches_a_lost_and_a_repeated_token() -> None:
    v = Verdict()
    failed = record(3, 5, 1, 0.0)
    failed.error = "APIError: rate limited by the fleet"
    count_check([record(0, 5, 5, 0.0), record(1, 5, 4, 0.0), record(2, 5, 6, 0.0), failed], v)
    assert (v.complete, v.tokens_lost, v.tokens_repeated) == (1, 1, 1) and not v.clean
    assert len(v.failed) == 1  # a refused request is a failure, not a lost token


def step(kind: str, started: float, finished: float | None) -> Step:
    return Step("op", 0, kind, "w", "a", "b", "decode", "done", started, finished, 1, 10.0, "")


def test_streams_open_during_a_move_are_the_ones_rerun() -> None:
    steps = [step("cold move", 10.0, 20.0), step("start", 0.0, 30.0)]
    assert crossed_a_move(record(0, 10, 10, 19.5), steps)  # open (19.5-20.4) at the switch
    assert not crossed_a_move(record(1, 10, 10, 9.5), steps)  # ended before the switch
    assert not crossed_a_move(record(2, 10, 10, 29.5), steps)  # starts carry no session
    assert not crossed_a_move(record(3, 10, 10, 15.0), [step("warm move", 10.0, None)])


def test_the_live_view_renders_at_80_columns() -> None:
    said: list[str] = []
    fw = FleetWatch(None, "tiny", 0.0, 0.0, said.append)  # type: ignore[arg-type]
    fw.samples = [Sample(1.0, 0.99, 1.5, 200, 40, 5.0, 2), Sample(2.0, 0.7, 1.6, 200, 90, 2.0, 2)]
    fw.below_for_s = 4.0
    fw.steps = {("op", 0): step("cold move", 1.0, 2.0)}
    fw.workers = [
        fpb.WorkerStatus(worker_id="w-1", node_name="h200-1", role=fpb.WORKER_ROLE_DECODE,
                         state=fpb.WORKER_STATE_SERVING)
    ]  # fmt: skip
    w = Workload([DemoRequest(0, 0.0, [300], 4, 1, PROMPT_HEAVY)], 40.0, 20.0, 0, "x")
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(render(fw, [record(0, 4, 4, 0.0)], w))
    text = console.export_text()
    assert "ALARM" in text and "cold move of w" in text and "h200-1" in text
    assert "decode@h200-1" in status_line(fw, [], w)


def test_a_summary_whose_moves_carried_nothing_says_why() -> None:
    fw = FleetWatch(None, "tiny", 0.0, 0.0, lambda _: None)  # type: ignore[arg-type]
    fw.threshold = 0.95
    move, start = step("cold move", 10.0, 22.5), step("start", 0.0, 9.0)
    move.sessions_carried = start.sessions_carried = 0
    fw.steps = {("op", 0): move, ("op", 1): start}
    w = Workload([DemoRequest(0, 0.0, [300], 4, 1, PROMPT_HEAVY)], 40.0, 20.0, 0, "x")
    records = [record(0, 4, 4, 0.0), record(1, 30, 30, 5.0)]  # the longest: 2.9 s
    text = "\n".join(summary_lines(w, records, fw, Verdict(), check_all=False))
    assert "sessions moved: 0" in text
    assert "no stream was open on a moved worker" in text and "lasted 2.9 s" in text
    move.sessions_carried = 2  # a move that carried sessions needs no excuse
    text = "\n".join(summary_lines(w, records, fw, Verdict(), check_all=False))
    assert "sessions moved: 2" in text and "longest stream" not in text


def test_carriers_run_only_while_a_move_is_under_way_and_scale_with_decoding_workers() -> None:
    fw = FleetWatch(None, "tiny", 0.0, 0.0, lambda _: None)  # type: ignore[arg-type]
    serving = fpb.WORKER_STATE_SERVING
    fw.workers = [
        fpb.WorkerStatus(worker_id="d", node_name="h200-1", role=fpb.WORKER_ROLE_DECODE, state=serving),
        fpb.WorkerStatus(worker_id="m", node_name="h100-1", role=fpb.WORKER_ROLE_MIXED, state=serving),
        fpb.WorkerStatus(worker_id="p", node_name="h100-2", role=fpb.WORKER_ROLE_PREFILL, state=serving),
    ]  # fmt: skip
    carriers = Carriers(None, "tiny", fw, 0.0, 512, 512, per_worker=3, cap=12)
    fw.steps = {("op", 0): step("start", 0.0, None), ("op", 1): step("cold move", 0.0, 9.0)}
    fw.steps[("op", 1)].worker = "m"
    assert carriers.wanted() == 0  # a start carries nothing, and the move is done
    fw.steps[("op", 1)].state = "running"
    assert carriers.wanted() == 6  # 3 for each of the two workers that decode
    fw.steps[("op", 1)].worker = "p"
    assert carriers.wanted() == 0  # a prefill worker's move: streams would not stay on it
    fw.steps[("op", 1)].worker = "m"
    carriers.cap = 4
    assert carriers.wanted() == 4
    fw.steps.clear()
    carriers.forced = True  # before the demo's own operator move
    assert carriers.wanted() == 4


def test_an_operator_move_goes_to_the_same_gpu_kind_first_and_is_labelled() -> None:
    nodes = [
        NodeSpec("a100-1", "NVIDIA A100-SXM4-80GB", 4),
        NodeSpec("h100-1", "NVIDIA H100 80GB HBM3", 4),
        NodeSpec("h100-2", "NVIDIA H100 80GB HBM3", 4),
        NodeSpec("h200-1", "NVIDIA H200", 4),
    ]
    w = fpb.WorkerStatus(worker_id="w", node_name="h100-1")
    busy = [w, fpb.WorkerStatus(worker_id="x", node_name="h200-1")]
    assert operator_targets(w, busy, nodes) == ["h100-2", "a100-1", "h200-1"]
    fw = FleetWatch(None, "tiny", 0.0, 0.0, lambda _: None)  # type: ignore[arg-type]
    fw.steps = {("op", 0): step("cold move", 10.0, 22.5)}
    fw.operations = {"op": opb.Operation(id="op", requested_by="loopback-dev")}
    work = Workload([DemoRequest(0, 0.0, [300], 4, 1, PROMPT_HEAVY)], 40.0, 20.0, 0, "x")
    text = "\n".join(summary_lines(work, [record(0, 4, 4, 0.0)], fw, Verdict(), check_all=False))
    assert "1 cold move (the demo's operator move); sessions moved: 1" in text, text
    assert "(a -> b, as decode) (operator move): carried 1" in text, text


def samples(*figures: tuple[float | None, int]) -> list[Sample]:
    """One sample a second: (efficiency, steps in flight)."""
    return [Sample(float(i), e, 1.0, 50, 200, 0.3, 2, n) for i, (e, n) in enumerate(figures)]


def test_the_figure_recovers_only_when_back_with_nothing_in_flight_for_three_polls() -> None:
    below, back = (0.5, 0), (0.97, 0)
    assert recovered_at(samples(below, back, back, back), 0.95) == 1.0
    assert recovered_at(samples(below, back, back), 0.95) is None  # two polls: not yet
    # over the line while a start still runs is not a recovery; it counts once that ended
    assert recovered_at(samples(below, (0.97, 1), (0.97, 1), (0.97, 1)), 0.95) is None
    assert recovered_at(samples(below, (0.97, 1), back, back, back), 0.95) == 2.0
    assert recovered_at(samples(back, back, back, back), 0.95) is None  # it never fell
    assert recovered_at(samples(below, back, back, back, below), 0.95) is None  # fell again
    assert recovered_at(samples(below, (None, 0), back, back, back), 0.95) == 2.0
    assert recovered_at(samples((0.95, 2), below, (0.95, 0), back, back), 0.95) == 2.0


def test_the_live_watch_says_recovered_once_and_not_while_a_plan_runs() -> None:
    said: list[str] = []
    fw = FleetWatch(None, "tiny", 0.0, 0.0, said.append)  # type: ignore[arg-type]
    for figure, flying in [(0.6, 1), (0.6, 1), (0.97, 1), (0.97, 0), (0.97, 0), (0.97, 0)]:
        fw.samples.append(Sample(float(len(fw.samples)), figure, 1.0, 50, 200, 0.3, 2, flying))
        fw._alarm(figure)
        fw._recovery()
    assert fw.recovered == 3.0
    assert sum("RECOVERED" in line for line in said) == 1 and "back since 3.0 s" in said[-1]
    w = Workload([DemoRequest(0, 0.0, [300], 4, 1, DECODE_HEAVY)], 4.0, 2.0, 0, "x")
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(render(fw, [], w))
    assert "RECOVERED at 3 s" in console.export_text()
    assert "settling" in status_line(fw, [], w) and "recovered at 3 s" in status_line(fw, [], w)


def test_the_summary_says_whether_and_when_it_recovered_and_why_not() -> None:
    fw = FleetWatch(None, "tiny", 0.0, 0.0, lambda _: None)  # type: ignore[arg-type]
    fw.threshold = 0.95
    fw.samples = samples((0.5, 0), (0.6, 1))
    running = step("start", 40.0, None)
    running.state, running.op_id = "running", "op-7"
    fw.steps = {("op-7", 0): running}
    why = why_not(fw.samples, [running], 0.95, 30.0, "unused")
    assert (
        why
        == "not back within --settle-s 30 s (at the end 0.60): 1 step(s) still in flight (start; op-7)"
    )
    w = Workload([DemoRequest(0, 0.0, [300], 4, 1, DECODE_HEAVY)], 40.0, 20.0, 0, "x")
    text = "\n".join(summary_lines(w, [], fw, Verdict(), False, outcome=Outcome(None, 0.6, why)))
    assert "recovered: no -- not back within --settle-s 30 s" in text, text
    running.state = "done"
    assert why_not(fw.samples, [running], 0.95, 30.0, "the dry run proposes no move").endswith(
        "nothing in flight; the dry run proposes no move"
    )
    assert "never fell below" in why_not(samples((0.99, 0)), [], 0.95, 30.0, "")
    fell_again = samples((0.5, 0), (0.97, 0), (0.97, 0), (0.97, 0), (0.8, 0))
    told = outcome(fell_again, [], 0.95, 30.0, "the dry run proposes no move", was_back=1.0)
    assert told.recovered is None and told.figure == 0.8
    assert told.why_not.endswith("(it was back at 1.0 s, then fell again)"), told.why_not
    assert outcome(fell_again[:4], [], 0.95, 30.0, "") == Outcome(1.0, 0.97)
    yes = Outcome(52.0, 0.97)
    assert (
        yes.line(0.95)
        == "recovered: yes, at 52.0 s (efficiency 0.97 >= 0.95 with no move in flight)"
    )


def test_settling_requests_cycle_the_decode_heavy_shapes_with_fresh_seeds() -> None:
    prompt = DemoRequest(0, 0.0, [300] * 50, 5, 1, PROMPT_HEAVY)
    decode = [DemoRequest(1, 30.0, [301] * 4, 90, 2, DECODE_HEAVY),
              DemoRequest(2, 31.0, [302] * 6, 70, 3, DECODE_HEAVY)]  # fmt: skip
    w = Workload([prompt, *decode], 40.0, 20.0, 0, "x")
    sent = [settling_request(w, i, 50.0 + i) for i in range(3)]
    assert [(len(r.prompt), r.max_tokens) for r in sent] == [(4, 90), (6, 70), (4, 90)]
    assert len({r.seed for r in sent}) == 3 and all(r.phase == SETTLING for r in sent)
    assert sent[2].at_s == 52.0

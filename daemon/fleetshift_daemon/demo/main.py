"""``fleetshift demo`` (``./scripts/demo``): the whole loop on one machine, in a few minutes.

It brings up a daemon (SQLite), four agents with declared A100/H100/H200 inventories, two
real workers of a small seeded reference model and the OpenAI-compatible gateway, all under
a state directory outside the checkout; replays a slice of a real trace through the gateway
with the official ``openai`` client while the mix turns from prompt-heavy to decode-heavy;
shows the daemon's traffic mix, efficiency, alarm, plan and moves live; checks that no
client lost or saw a token twice; writes a PNG timeline; and stops everything it started
(``--keep`` leaves the fleet running to explore). The planner runs in automatic mode with
short hold times, and every move is the daemon's own: the demo only sends traffic and reads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.live import Live

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as pgrpc
from fleetshift_common.helpformat import DefaultsHelpFormatter
from fleetshift_common.lifecycle import wait_or_timeout
from fleetshift_daemon.demo import report
from fleetshift_daemon.demo.carriers import Carriers, operator_move
from fleetshift_daemon.demo.replay import StreamRecord, openai_client, replay
from fleetshift_daemon.demo.settle import Outcome, outcome, steady
from fleetshift_daemon.demo.verify import Verdict, count_check, crossed_a_move, reference_check
from fleetshift_daemon.demo.view import render, status_line
from fleetshift_daemon.demo.watch import FleetWatch, watch
from fleetshift_daemon.demo.workload import Workload, WorkloadSpec, build_workload
from fleetshift_daemon.localfleet import (
    LocalFleet,
    NodeSpec,
    ServedModel,
    explore_commands,
    make_model,
    signals_held,
    stop_on_signals,
)

NODES = (
    NodeSpec("a100-1", "NVIDIA A100-SXM4-80GB", 4),
    NodeSpec("h100-1", "NVIDIA H100 80GB HBM3", 4),
    NodeSpec("h100-2", "NVIDIA H100 80GB HBM3", 4),
    NodeSpec("h200-1", "NVIDIA H200", 4),
)
# Where the planner itself puts a prompt-heavy mix: decode on the H200, prefill on an H100;
# (role, node, tensor parallel) each.
INITIAL = ((fpb.WORKER_ROLE_DECODE, "h200-1", 2), (fpb.WORKER_ROLE_PREFILL, "h100-1", 2))
PLANNER = (
    "[planner]\ninterval_s = 2\nthreshold = 0.95\nhold_s = 10\nhorizon_s = 3600\n"
    "automatic = true\nmax_moves_in_flight = 2\nmax_moves_per_model = 2\n"
)
DEFAULT_TRACE = "../shared/traces/azure_llm_2023_conv.csv"
# 180 s: the planner alarms a few seconds after the mix turns at half, acts 10 s later, and
# its steps (worker starts of 12-35 s on this CPU) finish before the end; 240 s added only
# a minute of settled traffic to the wall time.
DURATION_S = 180.0
SETTLE_TIMEOUT_S = 180.0  # after the last request: wait this long at most for running moves
# After the replay (and the operator move): how long to wait at most for the figure to come
# back (``demo.settle``), and at what rate the second half's shapes keep flowing meanwhile.
RECOVER_S, RECOVER_S_SHORT = 150.0, 15.0  # bounds, not tuned: --short stays short
SETTLE_RATE = 1.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleetshift demo",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " ").replace("``", ""),
        formatter_class=DefaultsHelpFormatter,
    )
    env = os.environ.get
    p.add_argument(
        "--trace",
        type=Path,
        default=Path(env("FLEETSHIFT_DEMO_TRACE", DEFAULT_TRACE)),
        help="an Azure-style CSV or Mooncake JSON-lines trace (env FLEETSHIFT_DEMO_TRACE)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the fleet keeps its state and logs (default: a new temporary directory)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="leave the fleet running after the replay, until Ctrl-C or a signal",
    )
    p.add_argument(
        "--short",
        action="store_true",
        help="a 45 s replay (tests, a quick look); same story, fewer requests",
    )
    p.add_argument("--duration", type=float, default=DURATION_S, help="replay seconds")
    p.add_argument("--compress", type=float, default=4.0, help="trace seconds per replay second")
    p.add_argument(
        "--rate",
        type=float,
        default=2.5,
        help="requests per replay second kept from the trace (the rest are thinned out)",
    )
    p.add_argument(
        "--prompt-scale",
        type=float,
        default=0.25,
        help="prompt lengths are multiplied by this (the demo model's context is 512 tokens)",
    )
    p.add_argument(
        "--output-scale",
        type=float,
        default=0.25,
        help="output lengths are multiplied by this (this CPU is no GPU)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help=(
            "after the replay, wait at most this long for the efficiency figure to be back at "
            f"its threshold with no move in flight (default {RECOVER_S:.0f} s, "
            f"{RECOVER_S_SHORT:.0f} s with --short; 0: do not wait)"
        ),
    )
    p.add_argument(
        "--settle-rate",
        type=float,
        default=SETTLE_RATE,
        help="requests per second of the decode-heavy half's shapes sent while waiting",
    )
    p.add_argument(
        "--trace-start", type=float, default=0.0, help="trace second the slice starts at"
    )
    p.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "small"],
        help="the reference model make_model writes for the workers",
    )
    p.add_argument(
        "--check",
        default="moved",
        choices=["moved", "all"],
        help="rerun the streams open when a move switched, or every stream, to compare",
    )
    p.add_argument(
        "--png", type=Path, default=None, help="timeline PNG (default: STATE_DIR/timeline.png)"
    )
    p.add_argument(
        "--no-live", action="store_true", help="print events and status lines, no live view"
    )
    return p


class Demo:
    def __init__(self, args: argparse.Namespace, console: Console) -> None:
        self.args = args
        self.console = console
        if args.short:
            args.duration, args.rate = 45.0, 2.5
        if args.settle_s is None:
            args.settle_s = RECOVER_S_SHORT if args.short else RECOVER_S
        self.state_dir = (
            args.state_dir or Path(tempfile.mkdtemp(prefix="fleetshift-demo-"))
        ).resolve()
        self.fleet: LocalFleet | None = None
        self.records: list[StreamRecord] = []
        self.carried: list[StreamRecord] = []  # the long streams kept open while moves run
        self.settling: list[StreamRecord] = []  # the decode-heavy shapes sent after the replay
        self.outcome = Outcome(None, None, "the replay did not end")
        self.model = args.preset  # the name the openai client asks for
        self.reference_endpoint = ""

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def run(self) -> int:
        began = time.monotonic()
        self.say(f"FleetShift demo: state and logs under {self.state_dir}")
        model_dir = make_model(self.state_dir / f"model-{self.args.preset}", self.args.preset)
        config = json.loads((model_dir / "config.json").read_text())
        spec = WorkloadSpec(
            self.args.trace,
            self.args.duration,
            self.args.compress,
            self.args.rate,
            self.args.prompt_scale,
            self.args.output_scale,
            self.args.trace_start,
        )
        workload = build_workload(
            spec, int(config["max_position_embeddings"]), int(config["vocab_size"])
        )
        served = ServedModel(
            self.model,
            model_dir,
            plan_as="llama2-70b",
            tp_options=(2,),
            slo_ttft_ms=2000.0,
            slo_tbt_ms=60.0,
        )
        self.fleet = fleet = LocalFleet(
            self.state_dir / "fleet",
            NODES,
            heartbeat_interval_s=0.5,
            node_lost_after_s=5.0,
            daemon_extra=PLANNER + served.toml(),
            agent_extra="worker_compile = false\nworker_threads = 1\n",
        )
        self.say(
            "starting the daemon (SQLite) and 4 agents with declared GPUs: a100-1 (4x A100), "
            "h100-1 and h100-2 (4x H100 each), h200-1 (4x H200) ..."
        )
        fleet.start(timeout_s=180)
        self.say(
            f"daemon on {fleet.daemon_address}; planner automatic, every 2 s, acting on a gap "
            "held 10 s (demo settings; the defaults are 30 s and 300 s)"
        )
        self.say(
            f"model {self.model!r}: a seeded reference model ({model_dir}); the "
            "daemon plans it as Llama-2-70B at tensor-parallel 2 on the declared GPUs, its "
            "workers compute on this CPU"
        )
        initial = INITIAL
        pool = ThreadPoolExecutor(len(initial) + 1)  # the workers start side by side
        try:
            # The reference worker belongs to no agent: nothing routes to it or moves it, so
            # rerunning a request there is the unmoved run the streams are compared with.
            reference = pool.submit(fleet.start_bare_worker, model_dir, "reference-worker")
            started = list(pool.map(lambda rn: fleet.start_worker(self.model, *rn), initial))
            self.reference_endpoint = reference.result()
        finally:  # a signal must not wait here for a start that the stop will end anyway
            pool.shutdown(wait=False, cancel_futures=True)
        for w, (role, node, _) in zip(started, initial, strict=True):
            self.say(f"worker {w.worker_id}: {fpb.WorkerRole.Name(role)[12:].lower()} on {node}")
        fleet.start_gateway([served])
        self.say(f"gateway (OpenAI API) on {fleet.gateway_url}")
        self.say(
            f"replaying {workload.description}; the mix turns decode-heavy at "
            f"{workload.turn_at_s:.0f} s"
        )
        watch_state, verdict = asyncio.run(self._replay(workload, model_dir, config))
        lines = report.summary_lines(
            workload,
            self.records,
            watch_state,
            verdict,
            self.args.check == "all",
            carriers=self.carried,
            settling=self.settling,
            outcome=self.outcome,
            settle_rate=self.args.settle_rate,
        )
        self.say("")
        self.say("Summary")
        for line in lines:
            self.say(line)
        png = self.args.png or self.state_dir / "timeline.png"
        self.say(
            report.plot_timeline(
                png, workload, [*self.records, *self.settling], watch_state, self.outcome
            )
        )
        self.say(f"wall time: {time.monotonic() - began:.0f} s")
        self._explore_hint()
        if self.args.keep:
            while True:
                time.sleep(3600)
        return 0 if verdict.clean and not verdict.failed else 1

    async def _replay(
        self, workload: Workload, model_dir: Path, config: dict[str, Any]
    ) -> tuple[FleetWatch, Verdict]:
        assert self.fleet is not None
        fleet = self.fleet
        live = self.console.is_terminal and not self.args.no_live
        async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
            started, wall = time.monotonic(), time.time()
            fw = FleetWatch(daemon, self.model, started, wall, self.say)
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(fw, stop))
            shower = asyncio.create_task(self._show(fw, workload, stop, live))
            client = openai_client(fleet.gateway_url)
            carriers = Carriers(
                client,
                self.model,
                fw,
                started,
                int(config["max_position_embeddings"]),
                int(config["vocab_size"]),
                records=self.carried,
            )
            stop_carriers = asyncio.Event()
            carrying = asyncio.create_task(carriers.run(stop_carriers))
            stop_steady = asyncio.Event()
            steadying: asyncio.Task[None] | None = None
            wanted = "the replay did not end"
            try:
                await replay(client, self.model, workload, self.records, started)
                steadying = asyncio.create_task(
                    steady(
                        client,
                        self.model,
                        workload,
                        self.args.settle_rate,
                        self.settling,
                        started,
                        stop_steady,
                    )
                )
                await self._settle(fw)
                if not any(s.sessions_carried for s in fw.steps_done()):
                    self.say(
                        f"[{fw.now():6.1f} s] no move carried a live session so far: the demo "
                        "moves the worker holding the most open streams itself, as an operator "
                        "would, with long streams kept open through the move"
                    )
                    await operator_move(daemon, carriers, NODES)
                stop_carriers.set()
                await carrying
                await self._recover(fw)
                wanted = "" if fw.recovered is not None else await _still_wanted(daemon)
                stop_steady.set()
                await steadying
                await asyncio.sleep(2)
            finally:
                stop_carriers.set()
                stop_steady.set()
                stop.set()
                await asyncio.gather(watcher, shower, carrying, *([steadying] if steadying else []))
                await client.close()
            self.outcome = outcome(
                fw.samples,
                list(fw.steps.values()),
                fw.threshold,
                self.args.settle_s,
                wanted,
                fw.first_recovered,
            )
            verdict = Verdict()
            streams = self.records + self.carried + self.settling
            count_check(streams, verdict)
            steps = list(fw.steps.values())
            chosen = [
                r
                for r in streams
                if not r.error and (self.args.check == "all" or crossed_a_move(r, steps))
            ]
            endpoint = self.reference_endpoint
            if chosen:
                self.say(
                    f"rerunning {len(chosen)} stream(s) on a worker outside the fleet "
                    f"({endpoint}, nothing moves it) to compare token for token ..."
                )
                await reference_check(endpoint, model_dir, chosen, verdict)
            return fw, verdict

    async def _settle(self, fw: FleetWatch) -> None:
        """Wait for the steps running when the traffic ends; when no step has finished at all
        yet (a short replay), wait for the planner's next plan to finish instead. Bounded."""
        running = fw.moves_running()
        self.say(
            f"[{fw.now():6.1f} s] every request answered; waiting for the {len(running)} "
            "step(s) still running"
            + (
                ""
                if running or fw.steps_done()
                else " -- none has finished yet, so for the planner's next plan"
            )
        )
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            pending = fw.moves_running()
            if running & pending:
                await asyncio.sleep(1)
                continue
            if fw.steps_done():
                return
            running = pending  # nothing finished yet: what the planner starts next
            await asyncio.sleep(1)
        self.say(f"[{fw.now():6.1f} s] stopped waiting after {SETTLE_TIMEOUT_S:.0f} s")

    async def _recover(self, fw: FleetWatch) -> None:
        """Wait, bounded by --settle-s, for the figure to be back (``watch.recovered_at``)
        while the second half's shapes keep flowing. Only waits: the figure is the daemon's,
        and ``settle.outcome`` reads what it did."""
        bound = self.args.settle_s
        if fw.recovered is None and bound > 0:
            self.say(
                f"[{fw.now():6.1f} s] waiting up to {bound:.0f} s (--settle-s) for the efficiency "
                f"figure to be back at {fw.threshold:.2f} with no move in flight, sending the "
                f"decode-heavy half's shapes at {self.args.settle_rate:g} request(s)/s"
            )
        deadline = time.monotonic() + bound
        while fw.recovered is None and time.monotonic() < deadline:
            await asyncio.sleep(1)
        if fw.recovered is None:
            fw.event(f"stopped waiting for the figure after {bound:.0f} s (--settle-s)")

    async def _show(
        self, fw: FleetWatch, workload: Workload, stop: asyncio.Event, live: bool
    ) -> None:
        if live:
            with Live(
                render(fw, self.records, workload), console=self.console, refresh_per_second=2
            ) as view:
                while not stop.is_set():
                    view.update(render(fw, self.records, workload))
                    await _pause(stop, 1.0)
            return
        while not stop.is_set():
            await _pause(stop, 10.0)
            self.say(status_line(fw, self.records, workload))

    def _explore_hint(self) -> None:
        fleet = self.fleet
        assert fleet is not None
        if not self.args.keep:
            self.say(
                "to keep the fleet running after the replay and explore it with grpcurl and "
                "the CLI: ./scripts/demo --keep"
            )
            return
        self.say("")
        self.say(
            f"The fleet keeps running (--keep); Ctrl-C here, or kill {os.getpid()}, stops "
            "everything it started. From this directory, in another shell:"
        )
        for cmd in explore_commands(fleet, self.model):
            self.say(f"  {cmd}")

    def stop(self) -> None:
        if self.fleet is not None:
            self.say("stopping the gateway, the workers, the agents and the daemon ...")
            self.fleet.stop()
            self.say("stopped")


async def _still_wanted(daemon: grpc.aio.Channel) -> str:
    """What the planner's dry run (``Planning/PlanRebalance``, nothing moves) would still do."""
    try:
        plan = await pgrpc.PlanningStub(daemon).PlanRebalance(
            ppb.PlanRebalanceRequest(), timeout=30
        )
    except grpc.aio.AioRpcError as err:
        return f"the planner's dry run did not answer ({err.code().name})"
    if not plan.moves:
        return "the planner's dry run proposes no move"
    kinds: dict[str, int] = {}
    for m in plan.moves:
        name = ppb.MoveKind.Name(m.kind).removeprefix("MOVE_KIND_").lower().replace("_", " ")
        kinds[name] = kinds.get(name, 0) + 1
    listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    verdict = "would propose it now" if plan.would_propose else "would hold it"
    return (
        f"the planner's dry run still wants {listed} (efficiency {plan.efficiency_before:.2f} "
        f"before, {'pays off' if plan.pays_off else 'does not pay off'} over its horizon; "
        f"the next pass {verdict}: {plan.decision_reason})"
    )


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    await wait_or_timeout(stop, seconds)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console = Console()
    with stop_on_signals():
        demo = Demo(args, console)
        try:
            return demo.run()
        except KeyboardInterrupt as err:
            console.print(f"interrupted ({err or 'SIGINT'})", markup=False)
            return 130
        except (ValueError, FileNotFoundError) as err:
            console.print(f"demo: {err}", markup=False)
            return 2
        finally:
            with signals_held():
                demo.stop()


if __name__ == "__main__":
    raise SystemExit(main())

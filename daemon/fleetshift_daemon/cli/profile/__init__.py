"""``fleetshift profile``: measure a model on the hardware a running worker has.

Sweeps concurrency geometrically (1, 4, 16, 64, 256) and prompt lengths (128 to 8192), bounded
by what the worker reports (KV pool, running-session limit) and the model's context; repeats
each point; finds the knee; writes ``OUT.csv`` (the reference table's shape), ``OUT.json``
(the machine and software it ran on, the measured peaks, the knees, the points left out) and
``OUT.png`` (throughput and latency against concurrency, knees marked). A worker on the CPU is
labelled ``cpu-<model name>``, never as a GPU kind.

On a fleet with TLS it dials the worker like the rest of the CLI dials the daemon, with the
fleet CA and the operator's certificate (``--ca``/``--cert``/``--key`` or ``FLEETSHIFT_CA``/
``_CERT``/``_KEY``); the worker's node must list that operator in its
``worker_session_callers`` (``operator:NAME``; only routers by default) for the sweep's
sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_common.config import ConfigError
from fleetshift_common.helpformat import DefaultsHelpFormatter, plain_description
from fleetshift_daemon.cli.profile import machine, output
from fleetshift_daemon.cli.profile.grid import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PROMPT_SIZES,
    Grid,
    Point,
    WorkerLimits,
    misfit,
    plan_grid,
)
from fleetshift_daemon.cli.profile.measure import HostSpeed, PointFailed, Timing, measure_point
from fleetshift_rpc.security import client_credentials

console = Console(stderr=True)
USAGE_EXAMPLE = (
    "example: fleetshift profile --worker 127.0.0.1:PORT --config MODEL_DIR --out prof/small.csv"
)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_LOOPBACK = ("127.", "localhost", "[::1]", "::1")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleetshift profile",
        description=plain_description(__doc__),
        epilog=USAGE_EXAMPLE,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--worker", required=True, help="the worker's WorkerService address")
    env = os.environ.get
    p.add_argument(
        "--ca", default=env("FLEETSHIFT_CA", ""), help="fleet CA: dial over TLS (env FLEETSHIFT_CA)"
    )
    p.add_argument(
        "--cert",
        default=env("FLEETSHIFT_CERT", ""),
        help="operator certificate, listed in the node's worker_session_callers "
        "(env FLEETSHIFT_CERT)",
    )
    p.add_argument(
        "--key", default=env("FLEETSHIFT_KEY", ""), help="its private key (env FLEETSHIFT_KEY)"
    )
    p.add_argument(
        "--config",
        required=True,
        type=Path,
        help="the model's config.json (or its directory): context and vocabulary",
    )
    p.add_argument("--out", required=True, type=Path, help="OUT.csv; OUT.json and OUT.png beside")
    p.add_argument("--model", default="", help="the CSV's model column (default: the worker's)")
    p.add_argument(
        "--hardware",
        default="",
        help="the CSV's hardware column (default: cpu-<model name> on a CPU worker, "
        "the GPU product otherwise)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY[-1],
        help="the sweep's largest batch, also bounded by the worker's running-session limit",
    )
    p.add_argument(
        "--prompt-sizes",
        type=_ints,
        default=list(DEFAULT_PROMPT_SIZES),
        help="comma-separated (default 128,256,...,8192)",
    )
    p.add_argument(
        "--token-size",
        type=int,
        default=32,
        help="output tokens per request: enough decode steps to time (>= 2)",
    )
    p.add_argument(
        "--min-decode-steps",
        type=int,
        default=8,
        help="decode steps with the whole batch decoding a run must time; a worker that "
        "spreads a batch's prefill over more steps gets that point re-run with more tokens",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the median is used")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=0.0,
        help="start no new point after this long (0: no limit); points left out "
        "are listed in the sidecar",
    )
    p.add_argument(
        "--point-timeout-s", type=float, default=900.0, help="give up a point after this long"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads for the peak figures")
    p.add_argument("--no-peaks", action="store_true", help="skip the matmul and copy timing")
    p.add_argument("--no-plot", action="store_true", help="write no OUT.png")
    p.add_argument("--seed", type=int, default=0, help="for the random prompts")
    return p


def read_model_config(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--config {file}: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {file}: not a JSON object")
    if not isinstance(raw.get("vocab_size"), int):
        raise ValueError(f"--config {file}: lacks vocab_size")
    if not any(isinstance(raw.get(k), int) for k in _CONTEXT_KEYS):
        raise ValueError(f"--config {file}: lacks {_CONTEXT_KEYS[0]} (the model's context)")
    return raw


def _context(cfg: dict[str, Any]) -> int:
    return next(int(cfg[k]) for k in _CONTEXT_KEYS if isinstance(cfg.get(k), int))


def _is_local(address: str) -> bool:
    return address.startswith(_LOOPBACK)


async def _get_info(channel: grpc.aio.Channel) -> worker_pb2.WorkerInfo:
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    info: worker_pb2.WorkerInfo = await stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=30)
    return info


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        console=console,
    )


async def _sweep(
    channel: grpc.aio.Channel,
    grid: Grid,
    limits: WorkerLimits,
    args: argparse.Namespace,
    vocab: int,
    probe: machine.HostProbe | None = None,
    worker_pid: int | None = None,
) -> tuple[list[Timing], list[str]]:
    """Every point ``args.repeats`` times; with a ``probe``, each run carries the host's speed
    (the mean of the probes just before and just after it: one probe between two runs); with
    the local worker's ``worker_pid``, the CPU seconds its process used over the run."""
    rng = random.Random(args.seed)
    timings: list[Timing] = []
    left_out: list[str] = []
    started = time.monotonic()
    # One discarded run first: thread pools, allocator and any lazy compilation warm up.
    smallest = grid.points[0]
    await measure_point(
        channel,
        Point(smallest.prompt_size, 1, smallest.token_size),
        vocab,
        rng,
        args.point_timeout_s,
    )
    with _progress() as progress:
        task = progress.add_task("profiling", total=len(grid.points) * args.repeats, last="")
        for point in grid.points:
            progress.update(
                task, description=f"prompt {point.prompt_size:5d} x batch {point.batch_size:3d}"
            )
            if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
                left_out.append(
                    f"prompt {point.prompt_size} x batch {point.batch_size}: "
                    f"past the {args.time_budget_s:g} s time budget"
                )
                progress.advance(task, args.repeats)
                continue
            done = 0
            before = probe() if probe else None
            while done < args.repeats:
                cpu0 = _cpu_s(worker_pid)
                t = await measure_point(channel, point, vocab, rng, args.point_timeout_s)
                cpu1 = _cpu_s(worker_pid)
                if cpu0 is not None and cpu1 is not None:
                    t = dataclasses.replace(t, worker_cpu_s=cpu1 - cpu0)
                if probe and before:
                    after = probe()
                    t = dataclasses.replace(t, host=machine.mean_speed(before, after))
                    before = after
                if t.decode_steps_timed < min(args.min_decode_steps, point.token_size - 1):
                    point, why = _longer(point, t, args.min_decode_steps, limits)
                    if why:
                        left_out.append(why)
                        break
                    continue  # measure again with the longer output; this run is not kept
                timings.append(t)
                done += 1
                progress.update(
                    task,
                    advance=1,
                    last=f"prefill {t.prompt_s * 1e3:8.1f} ms step {t.token_s * 1e3:7.2f} ms",
                )
            progress.advance(task, args.repeats - done)
    return timings, left_out


def _cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        return machine.process_cpu_s(pid)
    except (OSError, ValueError, IndexError):
        return None  # the worker went away: the sweep's next run says so


def _local_worker_pid(address: str) -> int | None:
    """The local worker's process, found by the port it listens on (None: not found)."""
    try:
        return machine.listening_pid(int(address.rsplit(":", 1)[1]))
    except (ValueError, IndexError):
        return None


def _longer(point: Point, t: Timing, min_steps: int, limits: WorkerLimits) -> tuple[Point, str]:
    """The point again with enough output tokens that ``min_steps`` decode steps run with the
    whole batch decoding (the worker spread the batch's prefill over ``stagger_steps``)."""
    longer = Point(point.prompt_size, point.batch_size, t.stagger_steps + min_steps + 2)
    why = misfit(limits, longer)
    if why:
        why = (
            f"prompt {point.prompt_size} x batch {point.batch_size}: its prefill spread over "
            f"{t.stagger_steps} steps, and the {longer.token_size} output tokens that would leave "
            f"{min_steps} whole-batch decode steps do not fit ({why})"
        )
    return longer, why


def _knee_table(summary: output.Summary) -> Table:
    table = Table(title="knee per prompt size (max of decode throughput / step time)")
    for col in ("prompt", "knee concurrency", "decode tokens/s", "step ms", "saturated"):
        table.add_column(col, justify="right")
    for prompt, k in sorted(summary.knees.items()):
        table.add_row(
            str(prompt),
            str(k.concurrency),
            f"{k.throughput:,.1f}",
            f"{k.latency * 1e3:.2f}",
            "yes" if k.saturated else "no (still rising)",
        )
    return table


def worker_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """Plaintext to a development worker; with ``--ca``, TLS with the given certificate, as
    ``fleetshift`` dials the daemon (a worker on a TLS node refuses plaintext)."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if not args.ca:
        if args.cert or args.key:
            raise ValueError("--cert and --key need --ca (the fleet CA)")
        return grpc.aio.insecure_channel(args.worker, options=options)
    try:
        creds = client_credentials(args.ca, args.cert, args.key)
    except (ConfigError, OSError) as err:
        raise ValueError(f"--ca/--cert/--key: {err}") from None
    return grpc.aio.secure_channel(args.worker, creds, options=options)


def _hint(err: grpc.aio.AioRpcError, args: argparse.Namespace) -> str:
    """What to change when the worker refused the profiler or could not be reached."""
    code = err.code()
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return (
            " (the profiler needs an operator certificate, --cert/--key, that the worker's "
            "node also lists in worker_session_callers, e.g. operator:NAME: a worker opens "
            "sessions only for those, routers by default)"
        )
    if code == grpc.StatusCode.UNAVAILABLE and not args.ca:
        return " (a worker on a node with TLS needs --ca and a certificate: --cert/--key)"
    return ""


async def run(args: argparse.Namespace) -> int:
    cfg = read_model_config(args.config)
    local = _is_local(args.worker)
    if args.token_size < 2 or args.repeats < 1 or args.max_concurrency < 1:
        raise ValueError("--token-size must be >= 2, --repeats and --max-concurrency >= 1")
    async with worker_channel(args) as channel:
        info = await _get_info(channel)
        hardware = machine.hardware_label(info, local, args.hardware)
        limits = WorkerLimits(
            kv_tokens=info.kv_blocks_total * info.kv_block_size,
            kv_block_size=info.kv_block_size or 1,
            max_running=info.max_running or args.max_concurrency,
            max_context=_context(cfg),
        )
        grid = plan_grid(limits, args.prompt_sizes, args.max_concurrency, args.token_size)
        if not grid.points:
            raise ValueError("no point of the sweep fits the worker: " + "; ".join(grid.skipped))
        peaks, probe, pid = None, None, None
        # A CPU's peaks are measured here (no datasheet figure would do); a GPU worker's kind
        # has the catalogue's, and this host's CPU peaks would describe nothing it ran on.
        if local and not args.no_peaks and machine.runs_on_cpu(info):
            console.print("timing this host's peak matmul and copy rates ...")
            peaks = machine.measure_peaks(args.threads)
            probe = machine.HostProbe(args.threads)
            pid = _local_worker_pid(args.worker)
            # best of 3, as the peaks are a best: a row's probe over this is its speed
            # relative to the peaks
            starts = [probe() for _ in range(3)]
            start = HostSpeed(
                max(s.matmul_gflops for s in starts), max(s.copy_gbps for s in starts)
            )
            peaks = dataclasses.replace(
                peaks, probe_matmul_gflops=start.matmul_gflops, probe_copy_gbps=start.copy_gbps
            )
        console.print(
            f"profiling {info.model_id} on {hardware}: {len(grid.points)} points x "
            f"{args.repeats} repeats ({len(grid.skipped)} left out by the worker's "
            "bounds)"
        )
        began = datetime.now(UTC)
        t0 = time.monotonic()
        timings, left_out = await _sweep(
            channel, grid, limits, args, int(cfg["vocab_size"]), probe, pid
        )
        wall_s = time.monotonic() - t0
    label = output.ProfileLabel(
        args.model or info.model_id, hardware, info.compat_key.tensor_parallel or 1
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    output.write_csv(args.out, label, timings)
    summary = output.summarise(timings)
    output.write_sidecar(
        args.out.with_suffix(".json"),
        {
            "profiled_at": began.isoformat(timespec="seconds"),
            "wall_s": round(wall_s, 2),
            "model": label.model,
            "hardware": hardware,
            "hardware_is_cpu": machine.runs_on_cpu(info),
            "tensor_parallel": label.tensor_parallel,
            "worker": {"address": args.worker, **machine.worker_description(info)},
            "host": machine.host_description(local, peaks),
            "model_config": cfg,
            "sweep": {
                "concurrency_max": args.max_concurrency,
                "prompt_sizes": sorted(set(args.prompt_sizes)),
                "token_size": args.token_size,
                "repeats": args.repeats,
                "time_budget_s": args.time_budget_s,
                "seed": args.seed,
                "limits": limits.__dict__,
                "left_out": [*grid.skipped, *left_out],
            },
            "decode_steps_timed_min": min(t.decode_steps_timed for t in timings),
        },
        summary,
    )
    console.print(_knee_table(summary))
    wrote = [args.out, args.out.with_suffix(".json")]
    if not args.no_plot:
        try:
            output.write_plot(
                args.out.with_suffix(".png"),
                f"{label.model} on {hardware} (TP {label.tensor_parallel})",
                summary,
            )
            wrote.append(args.out.with_suffix(".png"))
        except ImportError:
            console.print(f"[yellow]{output.NEED_MATPLOTLIB}[/]")
    console.print(f"{len(timings)} rows in {wall_s:.1f} s; wrote " + ", ".join(map(str, wrote)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return asyncio.run(run(args))
    except (ValueError, PointFailed) as err:
        console.print(f"[red]INVALID_ARGUMENT[/]: {err}")
        return 2
    except grpc.aio.AioRpcError as err:
        console.print(f"[red]{err.code().name}[/]: {err.details()}{_hint(err, args)}")
        return 1


if __name__ == "__main__":
    sys.exit(main())

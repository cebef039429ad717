"""What a daemon's heap holds under the load bench's fleet: the objects a full (generation 2)
collection walks. fs-17g's probe (``bench/load_heartbeats_routes.py --probe``) found gen2
pauses of 0.4-1.6 s on each replica's event loop under load; this counts what they walk.

One daemon in this process (SQLite, the load bench's configuration), 1,000 nodes registered
with two workers each, then ``--seconds`` of heartbeats at 1 Hz and Route calls; then the
tracked objects by type, and a full collection timed before and after ``gc.freeze()``. The
generation-2 collections the interpreter ran by itself during the heartbeats are timed too
(``gc.callbacks``: how many, the longest, their sum).

``--before-src DIR`` first runs the same in a process of its own from another source tree
(``git archive <commit> daemon common proto | tar -x -C DIR``), then this tree's, also in its
own process: the same-run baseline.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/daemon_heap.py
    PYTHONPATH=. nice -n 10 .venv/bin/python bench/daemon_heap.py --seconds 90 --before-src /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from load_heartbeats_routes import Load

from fleetshift_common.config import daemon_config
from fleetshift_daemon.app import Daemon


class Gen2Timer:
    """Times the generation-2 collections the interpreter runs by itself (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(1e3 * (time.perf_counter() - self._start))

    def summary(self) -> str:
        p = self.pauses
        return f"{len(p)} runs, max {max(p, default=0):.0f} ms, total {sum(p):.0f} ms"


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return 1e3 * (time.perf_counter() - start)


async def run(nodes: int, seconds: float, routes_per_s: float) -> None:
    tmp = Path(tempfile.mkdtemp())
    config_file = tmp / "daemon.toml"
    config_file.write_text(
        f'listen = "127.0.0.1:0"\nstate_dir = "{tmp}"\n'
        "heartbeat_interval_s = 1\nnode_lost_after_s = 10\nrate_limit_per_s = 1e9\n"
        "rate_limit_burst = 1000000000\n[planner]\ninterval_s = 30\n"
        '[[models]]\nname = "llama-70b"\npreset = "llama2-70b"\ntp_options = [4, 8]\n'
    )
    daemon = Daemon(daemon_config(config_file))
    await daemon.start()
    started = len(gc.get_objects())
    print(
        f"after start: {started:,} tracked objects, full collection {full_collection_ms():.0f} ms"
    )
    assert daemon.server is not None
    load = Load(f"127.0.0.1:{daemon.server.port}", nodes, routes_per_s, seconds, "stream")
    async with grpc.aio.insecure_channel(load.address) as ch:
        await load.register(ch)
    registered = len(gc.get_objects())
    print(
        f"after {nodes} nodes registered: {registered:,} objects, full {full_collection_ms():.0f} ms"
    )
    timer = Gen2Timer()
    gc.callbacks.append(timer)
    await load.run([], registered=True)
    gc.callbacks.remove(timer)
    print(f"gen2 collections during the heartbeats: {timer.summary()}")
    objects = gc.get_objects()
    print(
        f"after {seconds:.0f} s of heartbeats and {len(load.route_latency):,} Routes: "
        f"{len(objects):,} objects, full collection {full_collection_ms():.0f} ms"
    )
    by_type = collections.Counter(type(o).__name__ for o in objects)
    print("most common: " + ", ".join(f"{n} {c:,}" for n, c in by_type.most_common(12)))
    print(
        "the SLO monitor's: "
        + ", ".join(f"{n} {by_type[n]:,}" for n in ("LatencySample", "_Round", "_ModelState"))
    )
    del objects
    gc.freeze()
    print(f"frozen now: full collection {full_collection_ms():.1f} ms")
    gc.unfreeze()
    await daemon.stop(grace_s=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--routes-per-s", type=float, default=500.0)
    p.add_argument("--before-src", default="", help="first run the same from this source tree")
    p.add_argument("--label", default="this tree")
    args = p.parse_args()
    if args.before_src:  # each in a process of its own: before, then this tree
        rest = ["--nodes", str(args.nodes), "--seconds", str(args.seconds)]
        rest += ["--routes-per-s", str(args.routes_per_s)]
        root = Path(args.before_src).resolve()
        old = os.pathsep.join(str(root / d) for d in ("daemon", "common", "proto"))
        here = os.environ.get("PYTHONPATH", "")
        for label, path in ((f"before ({root})", old), ("this tree", "")):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (path, here) if x))
            print(f"## {label}", flush=True)
            cmd = [sys.executable, __file__, *rest, "--label", label]
            subprocess.run(cmd, env=env, check=True)
        return
    with open("/proc/loadavg") as f:
        print(
            f"# {args.label}: {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, "
            f"load {f.read().split()[:3]}"
        )
    import fleetshift_daemon.core.slo_monitor as slo

    print(f"# SLO monitor from {slo.__file__}", flush=True)
    asyncio.run(run(args.nodes, args.seconds, args.routes_per_s))
    with open("/proc/loadavg") as f:
        print(f"# done {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {f.read().split()[:3]}")


if __name__ == "__main__":
    main()

"""Time to first token: a warm restore from a snapshot against a cold start.

Every figure is measured in this run, on this machine, from real worker processes:

* cold start: ``python -m fleetshift_agent.worker --model-dir`` with torch.compile on and an
  empty inductor cache (load + digest + compile), then one request;
* warm restore: ``--restore-from`` a snapshot taken mid-generation from that cold worker,
  with the snapshot's compiled-graph artifacts and an empty inductor cache;
* restore without the artifacts (``--no-compile-artifacts``), also with an empty cache.

For each: process launch -> ready (port file), launch -> first token of a new request, and
for restores launch -> next token of a session carried in the snapshot. Ratios are printed
against the cold start measured in the same run.

    .venv/bin/python bench/engine_ttft.py --preset bench --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from fleetshift.v1 import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Launch:
    label: str
    ready_s: float
    first_token_s: float  # launch -> first token of a new request
    resumed_token_s: float | None  # launch -> next token of a restored session
    worker_log: str

    def phases(self) -> str:
        m = re.search(r"load ([\d.]+) s, compile warm-up ([\d.]+) s", self.worker_log)
        return f"load {m.group(1)} s, compile {m.group(2)} s" if m else "?"


def ensure_model(workdir: Path, preset: str) -> Path:
    model = workdir / f"model-{preset}"
    if not (model / "config.json").exists():
        cmd = [sys.executable, "-m", "fleetshift_agent.engine.make_model"]
        subprocess.run([*cmd, "--out", str(model), "--preset", preset, "--seed", "0"], check=True)
    return model


class Worker:
    def __init__(self, workdir: Path, label: str, args: list[str], threads: int) -> None:
        self.port_file = workdir / f"{label}.port"
        self.port_file.unlink(missing_ok=True)
        self.log_path = workdir / f"{label}.log"
        self.cache = Path(tempfile.mkdtemp(prefix="inductor-", dir=workdir))  # empty: no reuse
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(self.cache),
            "OMP_NUM_THREADS": str(threads),
        }
        env.pop("FLEETSHIFT_COMPILE", None)
        cmd = [
            sys.executable, "-m", "fleetshift_agent.worker", "--port-file", str(self.port_file),
            "--threads", str(threads), "--worker-id", label, *args,
        ]  # fmt: skip
        self.t0 = time.monotonic()
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self, timeout: float = 900) -> float:
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() - self.t0 > timeout:
                raise RuntimeError(f"worker failed:\n{self.log_path.read_text()}")
            time.sleep(0.02)
        return time.monotonic() - self.t0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{int(self.port_file.read_text())}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.cache, ignore_errors=True)


VOCAB = 32000  # set from the model's config.json in run()


def request(prompt_len: int, max_new: int, seed: int, sid: str = "") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        session_id=sid,
        prompt_tokens=[(7 * i + seed) % (VOCAB - 1) + 1 for i in range(prompt_len)],
        max_new_tokens=max_new,
        sampling=worker_pb2.WorkerSampling(temperature=0.7, top_p=0.9, seed=seed),
    )


def channel(address: str) -> grpc.aio.Channel:
    opts = [("grpc.max_receive_message_length", 1 << 30)]
    return grpc.aio.insecure_channel(address, options=opts)


async def first_token(
    stub: worker_pb2_grpc.WorkerServiceStub, req: worker_pb2.GenerateRequest
) -> None:
    async for _ in stub.Generate(req):
        return


async def make_snapshot(address: str, snap_root: Path, prompt_len: int) -> tuple[Path, float, int]:
    """Two sessions mid-generation, paused at a step boundary and snapshotted."""
    async with channel(address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        await stub.Pause(worker_pb2.WorkerPauseRequest())
        calls = [stub.Generate(request(prompt_len, 6, 100 + i, f"carried-{i}")) for i in range(2)]
        while (await stub.GetCounters(worker_pb2.GetWorkerCountersRequest())).live_sessions < 2:
            for call in calls:
                if call.done():
                    raise RuntimeError(
                        f"request failed: {await call.code()} {await call.details()}"
                    )
            await asyncio.sleep(0.01)
        await stub.Resume(worker_pb2.WorkerResumeRequest(steps=2))
        for call in calls:
            await call.read()
            await call.read()
        t = time.monotonic()
        snap = await stub.Snapshot(
            worker_pb2.WorkerSnapshotRequest(dir=str(snap_root), snapshot_id="bench")
        )
        took = time.monotonic() - t
        for call in calls:
            call.cancel()
    return Path(snap.path), took, snap.size_bytes


async def standby_restore(address: str, snap_path: Path) -> float:
    """Restore RPC into a running worker of the same model -> next token of a carried session."""
    async with channel(address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        while (await stub.GetCounters(worker_pb2.GetWorkerCountersRequest())).live_sessions:
            await asyncio.sleep(0.01)  # the sessions the snapshot was taken from are gone
        await stub.Resume(worker_pb2.WorkerResumeRequest())
        t = time.monotonic()
        await stub.Restore(worker_pb2.WorkerRestoreRequest(path=str(snap_path)))
        req = worker_pb2.GenerateRequest(resume_session_id="carried-0", resume_from_token=2)
        await first_token(stub, req)
        return time.monotonic() - t


async def measure(worker: Worker, label: str, prompt_len: int, resume: bool) -> Launch:
    ready = await asyncio.to_thread(worker.wait_ready)
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        resumed = None
        if resume:
            resume_req = worker_pb2.GenerateRequest(
                resume_session_id="carried-0", resume_from_token=2
            )
            await first_token(stub, resume_req)
            resumed = time.monotonic() - worker.t0
        await first_token(stub, request(prompt_len, 4, 1))
        first = time.monotonic() - worker.t0
    return Launch(label, ready, first, resumed, worker.log_path.read_text())


async def run(args: argparse.Namespace) -> None:
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(workdir, args.preset)
    global VOCAB
    VOCAB = json.loads((model / "config.json").read_text())["vocab_size"]
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model {model} ({size / 1e9:.2f} GB), threads={args.threads}, prompt={args.prompt}")
    snap_root = workdir / "snapshots"
    shutil.rmtree(snap_root, ignore_errors=True)
    snap_root.mkdir()
    results: dict[str, list[Launch]] = {"cold": [], "restore": [], "restore-no-artifacts": []}
    snap_path: Path | None = None
    standby: list[float] = []
    for rep in range(args.repeat):
        cold = Worker(workdir, "cold", ["--model-dir", str(model)], args.threads)
        try:
            results["cold"].append(await measure(cold, "cold", args.prompt, resume=False))
            if snap_path is None:
                snap_path, snap_s, snap_bytes = await make_snapshot(
                    cold.address, snap_root, args.prompt
                )
                print(f"snapshot: {snap_bytes / 1e9:.2f} GB written in {snap_s:.2f} s")
            standby.append(await standby_restore(cold.address, snap_path))
        finally:
            cold.kill()
        for label, extra in (("restore", ["--compile-artifacts"]), ("restore-no-artifacts", [])):
            w = Worker(workdir, label, ["--restore-from", str(snap_path), *extra], args.threads)
            try:
                results[label].append(await measure(w, label, args.prompt, resume=True))
            finally:
                w.kill()
        print(f"repeat {rep + 1}/{args.repeat} done")
    report(results)
    print(
        "standby: Restore RPC into a running worker of the same model -> next token of a "
        f"carried session: {statistics.median(standby):.2f} s (median of {len(standby)})"
    )


def report(results: dict[str, list[Launch]]) -> None:
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    print()
    print(
        f"{'start':<22}{'ready s':>9}{'1st token s':>13}{'resumed s':>11}  worker phases (last run)"
    )
    for label, runs in results.items():
        resumed = [r.resumed_token_s for r in runs if r.resumed_token_s is not None]
        print(
            f"{label:<22}{med([r.ready_s for r in runs]):>9.2f}"
            f"{med([r.first_token_s for r in runs]):>13.2f}"
            f"{(med(resumed) if resumed else float('nan')):>11.2f}  {runs[-1].phases()}"
        )
    cold = med([r.first_token_s for r in results["cold"]])
    warm = med([r.first_token_s for r in results["restore"]])
    noart = med([r.first_token_s for r in results["restore-no-artifacts"]])
    print()
    print(f"cold start / warm restore (launch -> first token): {cold / warm:.2f}x")
    print(f"restore without / with compiled artifacts:          {noart / warm:.2f}x")
    print(f"cold start / restore without artifacts:             {cold / noart:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fs-bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    asyncio.run(run(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

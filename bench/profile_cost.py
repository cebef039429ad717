"""What ``fleetshift profile`` costs: the wall time of a full sweep of a small reference model
on this machine, beside the baseline measured in the same run, the time the worker spent
serving the sweep's requests (the sum of every run's end-to-end time). Their difference is the
profiler's own overhead (warm-up run, peak timing, re-runs with longer outputs, files).

Starts a real worker process of a seeded model (``make_model`` preset), runs the command as an
operator would, and keeps the profile (CSV, sidecar, plot) under --out.

    .venv/bin/python bench/profile_cost.py --preset small --out /tmp/prof-small

A model of another shape than the presets (hold-out (c)'s third model), and a shorter sweep:

    .venv/bin/python bench/profile_cost.py --preset small --name wide --out /tmp/prof-wide \
        --shape num_hidden_layers=2,hidden_size=1024,num_attention_heads=16,\
num_key_value_heads=16,intermediate_size=4096 \
        --prompt-sizes 128,256,512 --max-concurrency 16 --repeats 2
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetshift_agent.engine.config import ModelConfig
from fleetshift_agent.engine.make_model import PRESETS, random_model
from fleetshift_agent.engine.tokenizer_file import write_tokenizer
from fleetshift_agent.engine.weights import save_model_dir

REPO = Path(__file__).resolve().parents[1]
# The sweep: the seeds' geometric concurrency up to what the worker runs at once, and prompt
# lengths up to the model's context; the worker's KV pool bounds the largest batches.
SWEEP = {"prompt_sizes": "128,256,512,1024,2048", "max_concurrency": 64, "token_size": 32,
         "repeats": 3, "time_budget_s": 0.0}  # fmt: skip


def shape(preset: str, overrides: str, dtype: str = "") -> ModelConfig:
    """The preset's config with ``key=int`` overrides (a shape no preset has), its weights
    stored in ``dtype`` when given (a GPU worker serves bfloat16)."""
    values = dataclasses.asdict(PRESETS[preset])
    if dtype:
        values["torch_dtype"] = dtype
    for item in filter(None, overrides.split(",")):
        key, _, raw = item.partition("=")
        if key.strip() not in values:
            raise SystemExit(f"--shape: {key!r} is not a ModelConfig field")
        values[key.strip()] = int(raw)
    values["head_dim"] = 0 if "head_dim" not in overrides else values["head_dim"]
    return ModelConfig(**values)


def write_model(cfg: ModelConfig, out: Path, seed: int) -> None:
    """A seeded random model directory of ``cfg``, as ``make_model`` writes a preset's."""
    save_model_dir(random_model(cfg, seed), out)
    write_tokenizer(out, cfg.vocab_size, seed)


def start_worker(
    model: Path, root: Path, args: argparse.Namespace
) -> tuple[subprocess.Popen[bytes], int]:
    """The worker process profiled: on ``--device`` (a CUDA worker when a GPU is there),
    with a KV pool of ``--num-blocks`` (a GPU's holds the sweep's largest batches of long
    prompts, which the CPU default leaves out)."""
    port_file = root / "worker.port"
    threads = args.threads
    cmd = [
        sys.executable, "-m", "fleetshift_agent.worker", "--port-file", str(port_file),
        "--no-compile", "--threads", str(threads), "--model-dir", str(model),
        "--max-running", "64", "--num-blocks", str(args.num_blocks), "--worker-id", "profiled",
        "--device", args.device,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = (root / "worker.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"worker did not start: {(root / 'worker.log').read_text()}")
        time.sleep(0.1)
    return proc, int(port_file.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="", help="the model's name (default: the preset's)")
    parser.add_argument("--shape", default="", help="KEY=INT,... overriding the preset's config")
    parser.add_argument("--device", default="cpu", help="the worker's torch device (cuda: a GPU)")
    parser.add_argument("--dtype", default="", help="the weights' dtype (default: the preset's)")
    parser.add_argument("--num-blocks", type=int, default=2048, help="the worker's KV blocks")
    for key, default in SWEEP.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_args()
    name = args.name or args.preset
    sweep = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SWEEP]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.out / name
        if not (model / "config.json").exists():
            write_model(shape(args.preset, args.shape, args.dtype), model, args.seed)
        proc, port = start_worker(model, root, args)
        try:
            csv_path = args.out / f"{name}.csv"
            cmd = [sys.executable, "-m", "fleetshift_daemon.cli.main", "profile",
                   "--worker", f"127.0.0.1:{port}", "--config", str(model),
                   "--out", str(csv_path), "--threads", str(args.threads), *sweep]  # fmt: skip
            t0 = time.monotonic()
            done = subprocess.run(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
            wall = time.monotonic() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    with csv_path.open() as fh:
        rows = list(csv.DictReader(fh))
    serving = sum(float(r["e2e_time"]) for r in rows) / 1e3
    sidecar = json.loads(csv_path.with_suffix(".json").read_text())
    points = len({(r["prompt_size"], r["batch_size"]) for r in rows})
    print(
        f"model {name}: {points} points x {args.repeats} repeats = {len(rows)} rows, "
        f"{len(sidecar['sweep']['left_out'])} left out by the worker's bounds"
    )
    print(f"fleetshift profile wall time     {wall:8.1f} s")
    print(f"baseline: serving the requests   {serving:8.1f} s (sum of every run's e2e time)")
    print(f"profiler overhead                {wall - serving:8.1f} s ({wall / serving - 1:+.0%})")
    print(
        "knees: "
        + ", ".join(f"prompt {k['prompt_size']}: {k['concurrency']}" for k in sidecar["knees"])
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

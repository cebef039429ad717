"""Snapshot write/restore throughput and peak memory against a plain sequential copy.

Why a baseline in the same run: disk and page-cache speed vary by machine and by the moment;
the promise is relative (a snapshot costs at most ~25% over copying the same bytes, and never
doubles the worker's memory), so each figure is printed next to the plain copy measured on the
same disk, in the same run, and their ratio.

Each phase runs in a fresh child process so its peak RSS (VmHWM) is its own:

* write: tensors (bf16 "weights" matrices + a bf16 KV block pool) are created, then
  alternately (a) their bytes are written to plain files with large ``os.write`` calls and
  fsynced, and (b) ``write_snapshot`` runs (hash while writing, fsync, atomic rename).
* restore: before each read the page cache of the files is dropped
  (``posix_fadvise(DONTNEED)``), then alternately (a) the files are read sequentially into a
  freshly allocated buffer of their size (the plain way to get the bytes into memory), and (b)
  ``load_tensors`` restores every group (SHA-256 verified while reading). The figure for
  ``verify()`` followed by ``load_tensors`` is printed too, and so is a read through one reused
  8 MiB buffer (the disk alone, no memory to fill) for reference.

Usage: python bench/snapshot_io.py [--dir DIR] [--gib 1.2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHUNK = 8 << 20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _key() -> Any:
    from fleetshift_common.compat import CompatKey

    return CompatKey(
        gpu_product="bench",
        gpu_count=1,
        compute_capability="0.0",
        driver_version="-",
        cuda_version="-",
        torch_version="2.13.0",
        engine_name="bench",
        engine_version="0",
        model_id="bench",
        weights_digest="-",
        dtype="bfloat16",
        quantization="none",
        tensor_parallel=1,
    )


def _tensors(total_bytes: int) -> dict[str, dict[str, Any]]:
    """~2/3 weights-like bf16 matrices (4096x4096 = 32 MiB each), ~1/3 a bf16 KV block pool."""
    import torch

    g = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    n_mats = max(1, int(total_bytes * 2 / 3) // (4096 * 4096 * 2))
    for i in range(n_mats):
        weights[f"layers.{i}.w"] = torch.empty(4096, 4096, dtype=torch.bfloat16).uniform_(
            -1, 1, generator=g
        )
    kv_bytes = total_bytes - n_mats * 4096 * 4096 * 2
    blocks = max(1, kv_bytes // (2 * 16 * 8 * 128 * 2))  # (k/v, block 16, 8 heads, dim 128)
    kv = {"pool": torch.empty(blocks, 2, 16, 8, 128, dtype=torch.bfloat16).uniform_(generator=g)}
    return {"weights": weights, "kv": kv}


def _plain_write(tensor_groups: dict[str, dict[str, Any]], out: Path) -> None:
    import torch

    out.mkdir()
    for group, tensors in tensor_groups.items():
        fd = os.open(out / group, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        for t in tensors.values():
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(view), CHUNK):
                piece = view[start : start + CHUNK]
                while piece:
                    piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
        os.close(fd)
    dfd = os.open(out, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _plain_read(paths: list[Path], into_memory: bool) -> int:
    """Sequential read of every file: into a fresh buffer of its size (the bytes end up in
    memory, as a restore needs) or, ``into_memory=False``, through one reused 8 MiB buffer
    (``cat > /dev/null``: the disk alone)."""
    import numpy as np

    reused = memoryview(bytearray(CHUNK))
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        size = os.fstat(fd).st_size
        if into_memory:
            buf = memoryview(np.empty(size, dtype=np.uint8))
            done = 0
            while done < size:
                done += os.readv(fd, [buf[done : done + CHUNK]])
            total += done
            del buf
        else:
            while n := os.readv(fd, [reused]):
                total += n
        os.close(fd)
    return total


def child_write(workdir: Path, total_bytes: int, repeats: int) -> dict[str, Any]:
    import torch
    from fleetshift_agent.snapshot import write_snapshot

    torch.set_num_threads(1)
    groups = _tensors(total_bytes)
    nbytes = sum(t.numel() * t.element_size() for g in groups.values() for t in g.values())
    rss0 = _status_kib("VmRSS")
    res: dict[str, Any] = {"tensor_bytes": nbytes, "plain_s": [], "snapshot_s": []}
    for i in range(repeats):
        plain = workdir / f"plain-{i}"
        t0 = time.perf_counter()
        _plain_write(groups, plain)
        res["plain_s"].append(time.perf_counter() - t0)
        shutil.rmtree(plain)
        sid = f"snap-{i}"
        t0 = time.perf_counter()
        info = write_snapshot(
            workdir, sid, key=_key(), spec={}, tensor_groups=groups, json_parts={"s": []}
        )
        res["snapshot_s"].append(time.perf_counter() - t0)
        if i == 0:
            res["snapshot_peak_extra_kib"] = _status_kib("VmHWM") - rss0
            res["snapshot_bytes"] = info.size_bytes
            res["snapshot_path"] = str(info.path)
        else:
            shutil.rmtree(info.path)
    res["rss_before_kib"] = rss0
    return res


def child_restore(snapshot: Path, repeats: int, mode: str) -> dict[str, Any]:
    import torch
    from fleetshift_agent.snapshot import open_snapshot

    torch.set_num_threads(1)
    files = sorted(p for p in snapshot.rglob("*") if p.is_file())
    rss0 = _status_kib("VmRSS")
    res: dict[str, Any] = {"plain_s": [], "disk_s": [], "restore_s": []}
    for i in range(repeats):
        _drop_cache(files)
        t0 = time.perf_counter()
        _plain_read(files, into_memory=False)
        res["disk_s"].append(time.perf_counter() - t0)
        _drop_cache(files)
        t0 = time.perf_counter()
        res["read_bytes"] = _plain_read(files, into_memory=True)
        res["plain_s"].append(time.perf_counter() - t0)
        _drop_cache(files)
        t0 = time.perf_counter()
        snap = open_snapshot(snapshot)
        if mode == "verify+load":
            snap.verify()
        loaded = [snap.load_tensors(g) for g in snap.tensor_groups]
        for part in snap.json_parts:
            snap.load_json(part)
        res["restore_s"].append(time.perf_counter() - t0)
        if i == 0:
            res["restore_peak_extra_kib"] = _status_kib("VmHWM") - rss0
            res["restored_tensor_bytes"] = sum(
                t.numel() * t.element_size() for g in loaded for t in g.values()
            )
        del loaded
    return res


def _run_child(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    ap.add_argument("--gib", type=float, default=1.2, help="tensor bytes, GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "write":
            r = child_write(Path(rest[0]), int(rest[1]), int(rest[2]))
        else:
            r = child_restore(Path(rest[0]), int(rest[1]), rest[2])
        print(json.dumps(r))
        return

    base = args.dir or Path(__file__).resolve().parent / "out"
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="snapshot-io-", dir=base))
    try:
        report(workdir, int(args.gib * (1 << 30)), args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def report(workdir: Path, total: int, repeats: int) -> None:
    w = _run_child("write", str(workdir), str(total), str(repeats))
    nbytes = w["tensor_bytes"]
    snap_bytes = w["snapshot_bytes"]
    print(f"tensors: {nbytes / 2**30:.3f} GiB; snapshot on disk {snap_bytes / 2**30:.3f} GiB")
    print(f"directory: {workdir} ({repeats} alternating repeats; median figures)")
    plain_w = statistics.median(w["plain_s"])
    snap_w = statistics.median(w["snapshot_s"])
    print(
        f"write   plain copy {_mbps(nbytes, plain_w):8.1f} MB/s | snapshot "
        f"{_mbps(nbytes, snap_w):8.1f} MB/s | ratio {plain_w / snap_w:.2f} (target >= 0.80)"
    )
    print(f"        each run plain s {_fmt(w['plain_s'])} | snapshot s {_fmt(w['snapshot_s'])}")
    for mode in ("load", "verify+load"):
        r = _run_child("restore", w["snapshot_path"], str(repeats), mode)
        plain_r = statistics.median(r["plain_s"])
        rest_r = statistics.median(r["restore_s"])
        print(
            f"restore plain read {_mbps(r['read_bytes'], plain_r):8.1f} MB/s | {mode:11s} "
            f"{_mbps(r['read_bytes'], rest_r):8.1f} MB/s | ratio {plain_r / rest_r:.2f} "
            f"(target >= 0.80)"
        )
        print(f"        each run plain s {_fmt(r['plain_s'])} | {mode} s {_fmt(r['restore_s'])}")
        disk_r = statistics.median(r["disk_s"])
        print(
            f"        (disk alone, read through a reused 8 MiB buffer: "
            f"{_mbps(r['read_bytes'], disk_r):.1f} MB/s; {mode} / that = {disk_r / rest_r:.2f})"
        )
        assert r["restored_tensor_bytes"] == nbytes
        extra = r["restore_peak_extra_kib"] * 1024
        print(
            f"        peak RSS growth during {mode}: {extra / 2**30:.3f} GiB = "
            f"{extra / nbytes:.2f}x the tensors (the restored tensors themselves are 1.00x)"
        )
    extra_w = w["snapshot_peak_extra_kib"] * 1024
    print(
        f"peak RSS growth during snapshot write: {extra_w / 2**20:.1f} MiB = "
        f"{extra_w / nbytes:.3f}x the tensors (process RSS before: "
        f"{w['rss_before_kib'] / 2**20:.2f} GiB)"
    )


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


if __name__ == "__main__":
    main()

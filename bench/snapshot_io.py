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
  ``load_tensors`` restores every group: ``load`` (default: each shard mapped copy-on-write
  and SHA-256-checked through the mapping), ``load-copy`` (``copy=True``: read into private
  memory, hashed while reading) and ``verify+load`` (``verify()`` first, then ``load``). A
  read through one reused 8 MiB buffer (the disk alone, no memory to fill) is printed for
  reference, and so is the CPU time of each phase.

Usage: python bench/snapshot_io.py [--dir DIR] [--gib 1.2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

CHUNK = 8 << 20
T = TypeVar("T")


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
    """~2/3 weights-like bf16 matrices (4096x4096 = 32 MiB each), ~1/3 a bf16 paged KV block
    pool (one tensor per layer, 16 layers)."""
    import torch

    g = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    n_mats = max(1, int(total_bytes * 2 / 3) // (4096 * 4096 * 2))
    for i in range(n_mats):
        weights[f"layers.{i}.w"] = torch.empty(4096, 4096, dtype=torch.bfloat16).uniform_(
            -1, 1, generator=g
        )
    kv_bytes = total_bytes - n_mats * 4096 * 4096 * 2
    layers = 16
    blocks = max(1, kv_bytes // layers // (2 * 16 * 8 * 128 * 2))  # k/v, 16 tokens, 8 heads, 128
    kv = {
        f"layers.{i}.kv": torch.empty(blocks, 2, 16, 8, 128, dtype=torch.bfloat16).uniform_(
            generator=g
        )
        for i in range(layers)
    }
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


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(res: dict[str, Any], label: str, fn: Callable[[], T]) -> T:
    """Run ``fn``, appending its wall seconds to ``res[label]`` and CPU seconds (all threads)
    to ``res[label + '_cpu']``."""
    c0, t0 = _cpu_s(), time.perf_counter()
    out = fn()
    res.setdefault(label, []).append(time.perf_counter() - t0)
    res.setdefault(label + "_cpu", []).append(_cpu_s() - c0)
    return out


def child_write(workdir: Path, total_bytes: int, repeats: int) -> dict[str, Any]:
    import torch

    from fleetshift_agent.snapshot import write_snapshot

    torch.set_num_threads(1)
    groups = _tensors(total_bytes)
    nbytes = sum(t.numel() * t.element_size() for g in groups.values() for t in g.values())
    rss0 = _status_kib("VmRSS")
    res: dict[str, Any] = {"tensor_bytes": nbytes, "rss_before_kib": rss0}
    for i in range(repeats):
        plain = workdir / f"plain-{i}"
        _timed(res, "plain_s", lambda p=plain: _plain_write(groups, p))  # type: ignore[misc]
        shutil.rmtree(plain)
        info = _timed(
            res,
            "snapshot_s",
            lambda i=i: write_snapshot(  # type: ignore[misc]
                workdir, f"snap-{i}", key=_key(), spec={}, tensor_groups=groups, json_parts={}
            ),
        )
        if i == 0:
            res["snapshot_peak_extra_kib"] = _status_kib("VmHWM") - rss0
            res["snapshot_bytes"] = info.size_bytes
            res["snapshot_files"] = sum(1 for p in info.path.rglob("*") if p.is_file())
            res["snapshot_path"] = str(info.path)
        else:
            shutil.rmtree(info.path)
    return res


def child_restore(snapshot: Path, repeats: int, mode: str) -> dict[str, Any]:
    import torch

    from fleetshift_agent.snapshot import open_snapshot

    torch.set_num_threads(1)
    files = sorted(p for p in snapshot.rglob("*") if p.is_file())
    rss0 = _status_kib("VmRSS")
    res: dict[str, Any] = {}

    def restore() -> list[dict[str, Any]]:
        snap = open_snapshot(snapshot)
        if mode == "verify+load":
            snap.verify()
        copy = mode == "load-copy"
        loaded = [snap.load_tensors(g, copy=copy) for g in snap.tensor_groups]
        for part in snap.json_parts:
            snap.load_json(part)
        return loaded

    for i in range(repeats):
        _drop_cache(files)
        _timed(res, "disk_s", lambda: _plain_read(files, into_memory=False))
        _drop_cache(files)
        res["read_bytes"] = _timed(res, "plain_s", lambda: _plain_read(files, into_memory=True))
        _drop_cache(files)
        loaded = _timed(res, "restore_s", restore)
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
    print(
        f"tensors: {nbytes / 2**30:.3f} GiB; snapshot on disk {w['snapshot_bytes'] / 2**30:.3f} "
        f"GiB in {w['snapshot_files']} files; {os.cpu_count()} CPUs; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"directory: {workdir} ({repeats} alternating repeats; medians)")
    _line("write", "plain copy+fsync", "snapshot", nbytes, w["plain_s"], w["snapshot_s"])
    _cpu_line(w, "plain_s", "snapshot_s")
    extra_w = w["snapshot_peak_extra_kib"] * 1024
    print(
        f"        peak RSS growth while writing: {extra_w / 2**20:.1f} MiB = "
        f"{extra_w / nbytes:.3f}x the tensors (RSS before, tensors included: "
        f"{w['rss_before_kib'] / 2**20:.2f} GiB)"
    )
    for mode in ("load", "load-copy", "verify+load"):
        r = _run_child("restore", w["snapshot_path"], str(repeats), mode)
        assert r["restored_tensor_bytes"] == nbytes
        _line("restore", "plain read", mode, r["read_bytes"], r["plain_s"], r["restore_s"])
        _cpu_line(r, "plain_s", "restore_s")
        disk = statistics.median(r["disk_s"])
        print(
            f"        disk alone (reused 8 MiB buffer): {_mbps(r['read_bytes'], disk):.1f} MB/s; "
            f"{mode} / that = {disk / statistics.median(r['restore_s']):.2f}"
        )
        extra = r["restore_peak_extra_kib"] * 1024
        print(
            f"        peak RSS growth during {mode}: {extra / 2**30:.3f} GiB = "
            f"{extra / nbytes:.2f}x the tensors (the restored tensors themselves are 1.00x)"
        )


def _line(what: str, base: str, mine: str, nbytes: int, base_s: list[float], mine_s: list[float]):
    b, m = statistics.median(base_s), statistics.median(mine_s)
    print(
        f"{what:7s} {base} {_mbps(nbytes, b):7.1f} MB/s | {mine} {_mbps(nbytes, m):7.1f} MB/s "
        f"| ratio {b / m:.2f} (target >= 0.80)"
    )
    print(f"        each run: {base} s {_fmt(base_s)} | {mine} s {_fmt(mine_s)}")


def _cpu_line(res: dict[str, Any], base: str, mine: str) -> None:
    print(
        f"        CPU s (all threads): baseline {_fmt(res[base + '_cpu'])} | "
        f"{_fmt(res[mine + '_cpu'])}"
    )


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


if __name__ == "__main__":
    main()

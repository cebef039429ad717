"""Carrying torch.compile's results to another process, so a restore does not recompile.

Two artifacts travel: torch's own portable cache (``torch.compiler.save_cache_artifacts``:
graph lowering results, and Triton kernels on GPUs) and, because that cache does not hold the
C++ kernels inductor builds on CPUs, an archive of the inductor cache directory with those
built kernels. Both are generated code that the destination loads, so they are only offered
to a restore whose compatibility key proves the identical platform, only after the snapshot's
SHA-256 check, and can be refused with ``--no-compile-artifacts``.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
from pathlib import Path

import torch

log = logging.getLogger("fleetshift.engine")

GRAPH_ARTIFACT = "compile_cache.bin"
KERNEL_ARTIFACT = "inductor_kernels.tar"
MAX_KERNEL_ARCHIVE = 256 << 20
_SKIP_DIR = "precompiled_headers"


def _cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def save_artifacts() -> dict[str, bytes]:
    """This process's compile results, or nothing when it compiled nothing."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {}
    out = {GRAPH_ARTIFACT: saved[0]}
    kernels = kernel_archive(_cache_dir())
    if kernels is not None:
        out[KERNEL_ARTIFACT] = kernels
    return out


def kernel_archive(root: Path) -> bytes | None:
    files = [
        p
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not p.is_symlink()
        and not p.name.endswith(".lock")
        and _SKIP_DIR not in p.relative_to(root).parts  # only needed to build, not to load
    ]
    total = sum(p.stat().st_size for p in files)
    if total > MAX_KERNEL_ARCHIVE:
        log.warning("inductor cache %s holds %d bytes: kernels not carried", root, total)
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(root)), recursive=False)
    return buf.getvalue()


def load_artifacts(artifacts: dict[str, bytes]) -> bool:
    """Installs carried compile results before the first compile; True when any was loaded."""
    loaded = False
    if KERNEL_ARTIFACT in artifacts:
        install_kernels(artifacts[KERNEL_ARTIFACT], _cache_dir())
        loaded = True
    if GRAPH_ARTIFACT in artifacts:
        torch.compiler.load_cache_artifacts(artifacts[GRAPH_ARTIFACT])
        loaded = True
    return loaded


def install_kernels(data: bytes, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.isfile() and not os.path.exists(root / m.name)  # never replace local files
        ]
        # The "data" filter refuses absolute paths, "..", links and device files.
        tar.extractall(root, members=members, filter="data")

"""A real process that writes a snapshot and is SIGKILLed at a chosen point.

Run as ``python crash_child.py ROOT MODE``. MODE is ``bytes:N`` (killed once N bytes have been
written), ``before_rename`` / ``after_rename`` (killed around the publishing rename), or
``none`` (runs to completion), or ``wait`` (waits for a line on stdin, then writes, so the
parent can kill it after a chosen delay). The child replaces ``os.write`` / ``os.rename`` in its own
process only to know *when* to kill itself; the snapshot code runs unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

SNAPSHOT_ID = "crashy"


def expected_tensors() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(42)
    return {
        "weights": {
            "w0": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),  # 2 MiB
            "w1": torch.randn(512, 1024, generator=g),  # 2 MiB
        },
        "kv": {"pool": torch.randn(4, 1024, 512, generator=g).to(torch.bfloat16)},  # 4 MiB
    }


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(root: Path, mode: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from helpers import make_key  # type: ignore[import-not-found]

    from fleetshift_agent.snapshot import write_snapshot

    real_write, real_rename = os.write, os.rename
    written = [0]
    if mode.startswith("bytes:"):
        limit = int(mode.split(":", 1)[1])

        def write(fd: int, data: bytes) -> int:  # type: ignore[type-arg]
            n = real_write(fd, data)
            written[0] += n
            if written[0] >= limit:
                die()
            return n

        os.write = write  # type: ignore[assignment]
    elif mode in ("before_rename", "after_rename"):

        def rename(src: str, dst: str) -> None:
            if mode == "before_rename":
                die()
            real_rename(src, dst)
            die()

        os.rename = rename  # type: ignore[assignment]
    print("ready", flush=True)
    if mode == "wait":
        sys.stdin.readline()
    write_snapshot(
        root,
        SNAPSHOT_ID,
        key=make_key(),
        spec={"crash": mode},
        tensor_groups=expected_tensors(),
        json_parts={"sessions": [{"id": "a", "tokens": list(range(100))}]},
        artifacts={"cache.bin": b"\x01" * 300_000},
    )
    print("done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

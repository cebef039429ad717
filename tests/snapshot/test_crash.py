"""A writer SIGKILLed at any point leaves a whole valid snapshot or none, never half of one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fleetshift_agent.snapshot import SnapshotStore

from .crash_child import SNAPSHOT_ID, expected_tensors

CHILD = Path(__file__).resolve().parent / "crash_child.py"
TOTAL_TENSOR_BYTES = 8 << 20


def _spawn(root: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(root), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _assert_whole_or_nothing(root: Path) -> bool:
    """Reopen the store as the agent would at start; returns whether the snapshot exists."""
    store = SnapshotStore(root)
    leftovers = sorted(p.name for p in root.iterdir() if p.name not in (".pins", SNAPSHOT_ID))
    assert leftovers == [], f"half-written directories survived: {leftovers}"
    listed = [s.snapshot_id for s in store.list()]
    if not (root / SNAPSHOT_ID).exists():
        assert listed == []
        return False
    assert listed == [SNAPSHOT_ID]
    snap = store.get(SNAPSHOT_ID)
    snap.verify()
    for group, tensors in expected_tensors().items():
        loaded = snap.load_tensors(group)
        assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert snap.load_artifact("cache.bin") == b"\x01" * 300_000
    return True


@pytest.mark.parametrize(
    ("mode", "survives"),
    [
        ("bytes:1", False),
        (f"bytes:{3 << 20}", False),  # inside the first tensor file
        (f"bytes:{TOTAL_TENSOR_BYTES + 1000}", False),  # tensors done, parts half written
        ("before_rename", False),
        ("after_rename", True),  # renamed but the parent directory not yet fsynced
        ("none", True),
    ],
)
def test_kill_at_a_chosen_point(tmp_path: Path, mode: str, survives: bool) -> None:
    child = _spawn(tmp_path, mode)
    _, _ = child.communicate(timeout=60)
    if mode == "none":
        assert child.returncode == 0
    else:
        assert child.returncode == -signal.SIGKILL
        assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir()) != survives
    assert _assert_whole_or_nothing(tmp_path) is survives


def test_kill_at_random_times(tmp_path: Path) -> None:
    outcomes = []
    # fixed spread of delays after the child starts writing; the last kill waits until the
    # snapshot directory appears (the child is then fsyncing the parent or exiting)
    for i, delay in enumerate([0.0, 0.01, 0.05, 0.2, None]):
        root = tmp_path / f"run{i}"
        child = _spawn(root, "wait")
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        if delay is None:
            deadline = time.monotonic() + 30
            while not (root / SNAPSHOT_ID).exists() and time.monotonic() < deadline:
                time.sleep(0.001)
        else:
            time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        outcomes.append(_assert_whole_or_nothing(root))
    assert outcomes[0] is False  # killed before it could have written 8 MiB and fsynced
    assert outcomes[-1] is True

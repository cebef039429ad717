"""The agent's directory of snapshots: listing, lookup, deletion, retention, crash clean-up.

Snapshots are large and disks are not, so old ones must go; but deleting the snapshot a
migration is restoring from (or one an operator pinned) would turn a move into data loss. The
store is therefore the only place that deletes, and it refuses to delete anything pinned
(persisted beside the snapshots, survives restarts) or in use (held by a running restore or
transfer in this process). Deletion renames the directory to a ``.tmp-`` name first, so a crash
mid-delete leaves garbage that the next start removes, never a half snapshot.
"""

from __future__ import annotations

import builtins
import logging
import os
import secrets
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetshift_agent.snapshot.errors import (
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotInUse,
    SnapshotNotFound,
)
from fleetshift_agent.snapshot.fileio import fsync_dir
from fleetshift_agent.snapshot.names import (
    INCOMING_PREFIX,
    TMP_PREFIX,
    check_name,
    is_safe_name,
)
from fleetshift_agent.snapshot.snapshot import Snapshot, open_snapshot
from fleetshift_agent.snapshot.writer import SnapshotInfo, write_snapshot
from fleetshift_common.compat import CompatKey

log = logging.getLogger(__name__)
PINS = ".pins"


@dataclass(frozen=True)
class RetentionPolicy:
    """Any combination; ``None`` disables a rule. Pinned or in-use snapshots always stay."""

    keep_last_per_model: int | None = None
    max_age_s: float | None = None
    max_total_bytes: int | None = None


@dataclass(frozen=True)
class SnapshotSummary:
    snapshot_id: str
    size_bytes: int
    created_at: float
    key: CompatKey
    pinned: bool
    in_use: bool

    @property
    def key_summary(self) -> str:
        return self.key.summary()


class SnapshotStore:
    def __init__(self, root: Path, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.clock = clock
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / PINS).mkdir(exist_ok=True)
        self._lock = threading.Lock()
        self._in_use: Counter[str] = Counter()
        self._receiving: set[str] = set()
        self.removed_at_start = self.cleanup_tmp()

    # -- writing and reading ----------------------------------------------------------------

    def write(self, snapshot_id: str, **kwargs: Any) -> SnapshotInfo:
        """``write_snapshot`` into this store, stamped by the store's clock."""
        return write_snapshot(self.root, snapshot_id, clock=self.clock, **kwargs)

    def path(self, snapshot_id: str) -> Path:
        return self.root / check_name("snapshot id", snapshot_id)

    def get(self, snapshot_id: str) -> Snapshot:
        path = self.path(snapshot_id)
        if path.is_symlink() or not path.is_dir():
            raise SnapshotNotFound(snapshot_id, f"not in the store at {self.root}")
        snap = open_snapshot(path)
        if snap.snapshot_id != snapshot_id:
            raise SnapshotCorrupt(
                snapshot_id, "manifest.json", f"names snapshot {snap.snapshot_id!r}"
            )
        return snap

    def list(self) -> list[SnapshotSummary]:
        """Every readable snapshot, oldest first (unreadable ones are logged and skipped)."""
        out = []
        for entry in os.scandir(self.root):
            if not is_safe_name(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue  # tmp/incoming/pins dirs, lost+found, stray files
            try:
                snap = self.get(entry.name)
            except (SnapshotCorrupt, SnapshotNotFound) as exc:
                log.warning("skipping unreadable snapshot %s: %s", entry.name, exc)
                continue
            out.append(self._summary(snap))
        return sorted(out, key=lambda s: (s.created_at, s.snapshot_id))

    def summary(self, snapshot_id: str) -> SnapshotSummary:
        return self._summary(self.get(snapshot_id))

    def _summary(self, snap: Snapshot) -> SnapshotSummary:
        manifest_size = (snap.path / "manifest.json").stat().st_size
        sid = snap.snapshot_id
        return SnapshotSummary(
            snapshot_id=sid,
            size_bytes=snap.manifest.data_bytes + manifest_size,
            created_at=snap.manifest.created_at,
            key=snap.key,
            pinned=self.is_pinned(sid),
            in_use=self._in_use[sid] > 0,
        )

    # -- protection -------------------------------------------------------------------------

    def pin(self, snapshot_id: str) -> None:
        self.get(snapshot_id)
        pin = self.root / PINS / snapshot_id
        pin.touch()
        fsync_dir(pin.parent)

    def unpin(self, snapshot_id: str) -> None:
        (self.root / PINS / check_name("snapshot id", snapshot_id)).unlink(missing_ok=True)

    def is_pinned(self, snapshot_id: str) -> bool:
        return (self.root / PINS / snapshot_id).exists()

    @contextmanager
    def using(self, snapshot_id: str) -> Iterator[Snapshot]:
        """Hold a snapshot in use (no deletion) for the duration of a restore or transfer."""
        with self._lock:
            snap = self.get(snapshot_id)
            self._in_use[snapshot_id] += 1
        try:
            yield snap
        finally:
            with self._lock:
                self._in_use[snapshot_id] -= 1
                if self._in_use[snapshot_id] <= 0:
                    del self._in_use[snapshot_id]

    # -- deletion and retention -------------------------------------------------------------

    def delete(self, snapshot_id: str) -> None:
        with self._lock:
            path = self.path(snapshot_id)
            if not path.is_dir():
                raise SnapshotNotFound(snapshot_id)
            if self.is_pinned(snapshot_id):
                raise SnapshotInUse(snapshot_id, "pinned")
            if self._in_use[snapshot_id]:
                raise SnapshotInUse(snapshot_id, "in use by a restore or transfer")
            self._remove(path, snapshot_id)

    def _remove(self, path: Path, snapshot_id: str) -> None:
        doomed = self.root / f"{TMP_PREFIX}deleted-{snapshot_id}-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def apply_retention(self, policy: RetentionPolicy) -> builtins.list[str]:
        """Delete what the policy no longer keeps; returns the deleted ids, oldest first."""
        with self._lock:
            snaps = self.list()
            protected = {s.snapshot_id for s in snaps if s.pinned or s.in_use}
            doomed = _expired(snaps, policy, self.clock()) - protected
            kept = [s for s in snaps if s.snapshot_id not in doomed]
            if policy.max_total_bytes is not None:
                total = sum(s.size_bytes for s in kept)
                for s in kept:  # oldest first
                    if total <= policy.max_total_bytes:
                        break
                    if s.snapshot_id not in protected:
                        doomed.add(s.snapshot_id)
                        total -= s.size_bytes
            deleted = [s.snapshot_id for s in snaps if s.snapshot_id in doomed]
            for sid in deleted:
                self._remove(self.root / sid, sid)
        return deleted

    # -- leftovers and transfers ------------------------------------------------------------

    def cleanup_tmp(self) -> builtins.list[str]:
        """Remove half-written (or half-deleted) ``.tmp-*`` directories; returns their names."""
        removed = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(TMP_PREFIX):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
                removed.append(entry.name)
        if removed:
            fsync_dir(self.root)
            log.info("removed %d unfinished snapshot directories: %s", len(removed), removed)
        return removed

    def incoming_dir(self, snapshot_id: str) -> Path:
        """Where a transfer keeps its partial files; survives restarts so transfers resume."""
        return self.root / f"{INCOMING_PREFIX}{check_name('snapshot id', snapshot_id)}"

    @contextmanager
    def receiving(self, snapshot_id: str) -> Iterator[Path]:
        """Claim the incoming directory of a transfer; a second concurrent claim is refused."""
        with self._lock:
            if snapshot_id in self._receiving:
                raise SnapshotInUse(snapshot_id, "already being received by another transfer")
            self._receiving.add(snapshot_id)
        try:
            yield self.incoming_dir(snapshot_id)
        finally:
            with self._lock:
                self._receiving.discard(snapshot_id)

    def discard_incoming(self, snapshot_id: str) -> None:
        shutil.rmtree(self.incoming_dir(snapshot_id), ignore_errors=True)

    def adopt_incoming(self, snapshot_id: str) -> Snapshot:
        """Verify a complete incoming snapshot and rename it into place atomically."""
        incoming = self.incoming_dir(snapshot_id)
        snap = open_snapshot(incoming)
        if snap.snapshot_id != snapshot_id:
            raise SnapshotCorrupt(snapshot_id, "manifest.json", "names another snapshot")
        snap.verify()
        with self._lock:
            final = self.path(snapshot_id)
            if final.exists():
                raise SnapshotExists(snapshot_id)
            for sub in incoming.iterdir():
                if sub.is_dir():
                    fsync_dir(sub)
            fsync_dir(incoming)
            os.rename(incoming, final)
            fsync_dir(self.root)
        return self.get(snapshot_id)


def _expired(snaps: list[SnapshotSummary], policy: RetentionPolicy, now: float) -> set[str]:
    doomed: set[str] = set()
    if policy.max_age_s is not None:
        doomed |= {s.snapshot_id for s in snaps if now - s.created_at > policy.max_age_s}
    if policy.keep_last_per_model is not None:
        seen: Counter[str] = Counter()
        for s in reversed(snaps):  # newest first
            seen[s.key.model_id] += 1
            if seen[s.key.model_id] > policy.keep_last_per_model:
                doomed.add(s.snapshot_id)
    return doomed

"""Snapshots of inference workers: format, verification, store and agent-to-agent transfer.

A snapshot is a directory (manifest.json + safetensors tensor files + JSON parts + opaque
artifacts) that is written atomically, verified byte for byte before use, and never executes
anything it contains.
"""

from fleetshift_agent.snapshot.errors import (
    InvalidSnapshotName,
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotIncompatible,
    SnapshotInUse,
    SnapshotNotFound,
    SnapshotPartNotFound,
    TransferFailed,
    UnsafeTensorFile,
)
from fleetshift_agent.snapshot.manifest import FileEntry, Manifest
from fleetshift_agent.snapshot.snapshot import Snapshot, open_snapshot
from fleetshift_agent.snapshot.store import RetentionPolicy, SnapshotStore, SnapshotSummary
from fleetshift_agent.snapshot.writer import SnapshotInfo, write_snapshot

__all__ = [
    "FileEntry",
    "InvalidSnapshotName",
    "Manifest",
    "RetentionPolicy",
    "Snapshot",
    "SnapshotCorrupt",
    "SnapshotExists",
    "SnapshotInUse",
    "SnapshotIncompatible",
    "SnapshotInfo",
    "SnapshotNotFound",
    "SnapshotPartNotFound",
    "SnapshotStore",
    "SnapshotSummary",
    "TransferFailed",
    "UnsafeTensorFile",
    "open_snapshot",
    "write_snapshot",
]

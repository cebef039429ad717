"""Typed snapshot errors, each a member of the shared catalogue.

Every error names the snapshot and, where one is at fault, the file and what is wrong with it,
so an operator reading a failed restore or transfer knows which bytes to distrust without
opening the directory.
"""

from __future__ import annotations

from fleetshift_common.compat import CompatVerdict
from fleetshift_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)


class SnapshotCorrupt(FailedPrecondition):
    """A snapshot (or one of its files) is not what its manifest promises, or is unsafe."""

    def __init__(self, snapshot: str, file: str, problem: str) -> None:
        super().__init__(f"snapshot {snapshot!r}: file {file!r}: {problem}", field=file)
        self.snapshot = snapshot
        self.file = file
        self.problem = problem


class UnsafeTensorFile(SnapshotCorrupt):
    """A tensor file is not plain safetensors (pickle, zip, lying header); it is never run."""


class SnapshotIncompatible(FailedPrecondition):
    """The destination's key differs from the snapshot's; carries the full verdict."""

    def __init__(self, snapshot: str, verdict: CompatVerdict) -> None:
        super().__init__(
            f"snapshot {snapshot!r} cannot be restored warm here: {verdict.describe()}",
            field=",".join(verdict.differing_fields) or None,
        )
        self.snapshot = snapshot
        self.verdict = verdict


class SnapshotNotFound(NotFound):
    def __init__(self, snapshot: str, detail: str = "") -> None:
        super().__init__(f"snapshot {snapshot!r} not found{': ' + detail if detail else ''}")
        self.snapshot = snapshot


class SnapshotPartNotFound(NotFound):
    """A tensor group, JSON part, artifact or file the snapshot does not contain."""

    def __init__(self, snapshot: str, part: str) -> None:
        super().__init__(f"snapshot {snapshot!r} has no {part}", field=part)
        self.snapshot = snapshot


class SnapshotExists(AlreadyExists):
    def __init__(self, snapshot: str) -> None:
        super().__init__(f"snapshot {snapshot!r} already exists")
        self.snapshot = snapshot


class SnapshotInUse(FailedPrecondition):
    def __init__(self, snapshot: str, why: str) -> None:
        super().__init__(f"snapshot {snapshot!r} is {why}; it cannot be deleted")
        self.snapshot = snapshot


class InvalidSnapshotName(InvalidArgument):
    def __init__(self, what: str, name: str) -> None:
        super().__init__(
            f"invalid {what} {name!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or "
            "digit",
            field=what,
        )


class TransferFailed(Unavailable):
    """A transfer could not be completed within its retry budget."""

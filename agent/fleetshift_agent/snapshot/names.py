"""Names inside a snapshot, checked before they ever become paths.

A manifest is data from another machine; a file name in it like ``../../etc/passwd`` must not
turn into a path outside the snapshot. Every name that reaches the filesystem goes through
this module, which only admits one flat component per kind of part.
"""

from __future__ import annotations

import re

from fleetshift_agent.snapshot.errors import InvalidSnapshotName

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
INCOMING_PREFIX = ".incoming-"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# directory in the snapshot -> suffix of its files
KINDS: dict[str, str] = {"tensors": ".safetensors", "json": ".json", "artifacts": ""}


def is_safe_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not is_safe_name(name):
        raise InvalidSnapshotName(what, str(name))
    return name


def tensor_file(group: str) -> str:
    return f"tensors/{check_name('tensor group', group)}.safetensors"


def json_file(part: str) -> str:
    return f"json/{check_name('json part', part)}.json"


def artifact_file(name: str) -> str:
    return f"artifacts/{check_name('artifact', name)}"


def split_file_name(path: str) -> tuple[str, str] | None:
    """``'tensors/weights.safetensors'`` -> ``('tensors', 'weights')``; None if not admissible."""
    kind, sep, rest = path.partition("/")
    if not sep or kind not in KINDS:
        return None
    suffix = KINDS[kind]
    if suffix:
        if not rest.endswith(suffix):
            return None
        rest = rest[: -len(suffix)]
    return (kind, rest) if is_safe_name(rest) else None

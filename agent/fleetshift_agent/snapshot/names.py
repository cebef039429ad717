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


_SHARD = re.compile(r"(?P<group>[^@]+)@(?P<index>[1-9][0-9]{0,5})-of-(?P<count>[1-9][0-9]{0,5})")


def tensor_file(group: str, index: int = 1, count: int = 1) -> str:
    """``tensors/<group>.safetensors``, or ``tensors/<group>@<i>-of-<n>.safetensors`` (1-based)
    when a large group is split into shards that can be hashed in parallel."""
    check_name("tensor group", group)
    if count == 1:
        return f"tensors/{group}.safetensors"
    return f"tensors/{group}@{index}-of-{count}.safetensors"


def parse_tensor_stem(stem: str) -> tuple[str, int, int] | None:
    """``'weights@2-of-3'`` -> ``('weights', 2, 3)``; ``'kv'`` -> ``('kv', 1, 1)``."""
    if is_safe_name(stem):
        return stem, 1, 1
    m = _SHARD.fullmatch(stem)
    if not m or not is_safe_name(m["group"]):
        return None
    index, count = int(m["index"]), int(m["count"])
    return (m["group"], index, count) if 1 <= index <= count and count > 1 else None


def json_file(part: str) -> str:
    return f"json/{check_name('json part', part)}.json"


def artifact_file(name: str) -> str:
    return f"artifacts/{check_name('artifact', name)}"


def split_file_name(path: str) -> tuple[str, str] | None:
    """``'tensors/weights@1-of-2.safetensors'`` -> ``('tensors', 'weights')``, ``'json/a.json'``
    -> ``('json', 'a')``; None if the name is not admissible."""
    kind, sep, rest = path.partition("/")
    if not sep or kind not in KINDS:
        return None
    suffix = KINDS[kind]
    if suffix:
        if not rest.endswith(suffix):
            return None
        rest = rest[: -len(suffix)]
    if kind == "tensors":
        parsed = parse_tensor_stem(rest)
        return (kind, parsed[0]) if parsed else None
    return (kind, rest) if is_safe_name(rest) else None

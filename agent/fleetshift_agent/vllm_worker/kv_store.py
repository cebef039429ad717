"""The disk connector's store on disk: one folder per exported session, deleted once used.

FleetShift's connector (``server.DISK_CONNECTOR_SOURCE``) writes a session's KV only when an
export asks for it and reads it only for the import it was made for: both requests name the
export's id in vLLM's ``kv_transfer_params``, and the folder is named by that id and the
tokens, so no other request (ordinary traffic, another session with the same prefix) ever
writes or reads it. That makes each folder single-use, and the store bounded:

- the importing worker deletes the folder as soon as its request has its first token (vLLM
  loads the KV before it computes anything, so the files are no longer needed);
- an export nobody imported (a move rolled back, a worker that died between export and
  import) is deleted by the TTL sweep that every worker with the store runs: a folder older
  than ``kv_store_ttl_s`` goes. An import takes the KV only from a folder younger than half
  the TTL, so a sweep never deletes a folder vLLM is about to read.

Only FleetShift's own folders are touched: ``fs-<export id>-<digest of the tokens>``, as the
connector names them (the shim needs only the id to find them).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import uuid
from pathlib import Path

PREFIX = "fs-"
ID = re.compile(r"^[0-9a-f]{32}$")
FOLDER = re.compile(r"^fs-[0-9a-f]{32}-[0-9a-f]{32}$")


def new_id() -> str:
    return uuid.uuid4().hex


def folders_of(store: str | Path, export_id: str) -> list[Path]:
    if not ID.match(export_id):
        return []
    return sorted(Path(store).glob(f"{PREFIX}{export_id}-*"))


def age_s(store: str | Path, export_id: str, now: float) -> float | None:
    """How old the export's folder is (its last write), None when there is none."""
    found = folders_of(store, export_id)
    if not found:
        return None
    with contextlib.suppress(FileNotFoundError):
        return now - max(p.stat().st_mtime for p in found)
    return None


def remove(store: str | Path, export_id: str) -> int:
    """Delete the export's folder(s); how many went."""
    gone = 0
    for folder in folders_of(store, export_id):
        shutil.rmtree(folder, ignore_errors=True)
        gone += 1
    return gone


def sweep(store: str | Path, ttl_s: float, now: float) -> int:
    """Delete FleetShift's folders older than ``ttl_s`` (by their last write); how many went.
    Another worker sweeping the same store at once is harmless (a folder goes once)."""
    root = Path(store)
    if not root.is_dir():
        return 0
    gone = 0
    for entry in root.iterdir():
        if not FOLDER.match(entry.name):
            continue
        try:
            old = now - entry.stat().st_mtime > ttl_s
        except FileNotFoundError:
            continue
        if old:
            shutil.rmtree(entry, ignore_errors=True)
            gone += 1
    return gone

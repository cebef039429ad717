"""Every way a worker restores a snapshot refuses a file the manifest does not list (issue 13
item 2): ``--restore-from`` on a real worker process, and the Restore RPC of a running one.
``verify()`` always refused such a directory; the restore paths used to serve from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine.state import capture_state
from fleetshift_agent.snapshot import SnapshotCorrupt, open_snapshot
from fleetshift_agent.worker.snapshots import (
    engine_from_snapshot,
    engine_key,
    write_engine_snapshot,
)

from .helpers import REQUESTS, add_all, new_engine
from .workers import Workers, stub, workers_in

pytestmark = pytest.mark.slow
EVIL = "tensors/evil.py"


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    yield from workers_in(tmp_path)


def tampered_snapshot(model: Path, root: Path) -> Path:
    """A good snapshot of a running engine, plus one file nobody listed."""
    root.mkdir(parents=True, exist_ok=True)
    engine = new_engine(model)
    add_all(engine, REQUESTS)
    engine.step()
    info = write_engine_snapshot(capture_state(engine), engine_key(engine), root, "tampered")
    (info.path / EVIL).write_text("import os; os.system('echo owned')\n")
    return info.path


def test_library_restore_refuses_an_unlisted_file(tiny_model: Path, tmp_path: Path) -> None:
    path = tampered_snapshot(tiny_model, tmp_path)
    with pytest.raises(SnapshotCorrupt) as err:
        engine_from_snapshot(open_snapshot(path))
    assert err.value.file == EVIL and "not listed in the manifest" in err.value.message


def test_worker_restore_from_refuses_an_unlisted_file(
    tiny_model: Path, tmp_path: Path, workers: Workers
) -> None:
    path = tampered_snapshot(tiny_model, tmp_path / "snaps")
    with pytest.raises(RuntimeError) as err:
        workers.start("--restore-from", str(path), timeout=60)
    assert EVIL in str(err.value) and "not listed in the manifest" in str(err.value)


async def test_restore_rpc_refuses_an_unlisted_file(
    tiny_model: Path, tmp_path: Path, workers: Workers
) -> None:
    path = tampered_snapshot(tiny_model, tmp_path / "snaps")
    worker = workers.start("--model-dir", str(tiny_model), "--num-blocks", "64")
    async with worker.channel() as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub(ch).Restore(worker_pb2.WorkerRestoreRequest(path=str(path)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert EVIL in err.value.details()
        info = await stub(ch).GetInfo(worker_pb2.GetWorkerInfoRequest())
        assert list(info.session_ids) == []  # nothing of the snapshot was taken in

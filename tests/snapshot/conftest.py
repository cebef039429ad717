from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import ARTIFACTS, JSON_PARTS, make_key, sample_tensors


@pytest.fixture
def write_sample(tmp_path: Path):
    from fleetshift_agent.snapshot import write_snapshot

    def write(snapshot_id: str = "snap-1", root: Path | None = None, **kw: object):
        return write_snapshot(
            root or tmp_path,
            snapshot_id,
            key=kw.pop("key", make_key()),  # type: ignore[arg-type]
            spec=kw.pop("spec", {"model": "tiny-llama", "max_batch": 4}),  # type: ignore[arg-type]
            tensor_groups=kw.pop("tensor_groups", sample_tensors()),  # type: ignore[arg-type]
            json_parts=kw.pop("json_parts", JSON_PARTS),  # type: ignore[arg-type]
            artifacts=kw.pop("artifacts", ARTIFACTS),  # type: ignore[arg-type]
            **kw,  # type: ignore[arg-type]
        )

    return write

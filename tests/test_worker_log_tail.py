"""What an agent says when a worker it started dies before it serves (issue 13 item 12)."""

from __future__ import annotations

from pathlib import Path

from fleetshift_agent.supervisor import _tail

TRACEBACK = """loading weights from /models/x
Traceback (most recent call last):
  File "/app/fleetshift_agent/worker/__main__.py", line 4, in <module>
    main()
  File "/app/fleetshift_agent/snapshot/store.py", line 88, in open_snapshot
    raise SnapshotCorrupt(f"{name}: checksum mismatch")
fleetshift_agent.snapshot.errors.SnapshotCorrupt: tensors/layer0.safetensors: checksum mismatch
"""


def test_a_traceback_is_told_as_the_exception_that_ended_the_worker(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(TRACEBACK)
    assert _tail(log) == "SnapshotCorrupt: tensors/layer0.safetensors: checksum mismatch"


def test_a_log_without_a_traceback_keeps_its_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("a\nb\n\nc\nd\ne\nf\n")
    assert _tail(log) == "b | c | d | e | f"
    assert _tail(tmp_path / "missing.log") == "(no log)"

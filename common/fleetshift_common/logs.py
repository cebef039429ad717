"""Logging set-up shared by every FleetShift process.

On a terminal people read lines; everywhere else machines do, so the default there is one JSON
object per line. Under systemd (``JOURNAL_STREAM`` is set) the journal stamps each line itself,
so our own timestamp is left out.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from fleetshift_common.sdnotify import stderr_is_journal

_RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, with_time: bool) -> None:
        super().__init__()
        self._with_time = with_time

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self._with_time:
            entry["ts"] = round(record.created, 3)
        # Context passed with `extra=` (node, operation ids ...) becomes fields of the line.
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(log_format: str = "auto", level: int = logging.INFO) -> None:
    under_journal = stderr_is_journal()
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    if use_json:
        handler.setFormatter(JsonFormatter(with_time=not under_journal))
    else:
        fmt = "%(levelname)s %(name)s: %(message)s"
        handler.setFormatter(logging.Formatter(fmt if under_journal else "%(asctime)s " + fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)

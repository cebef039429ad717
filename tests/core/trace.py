"""Read the Azure LLM trace (or any CSV with the same three columns) for the core's tests."""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import numpy as np


def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds since the first request, prompt tokens, output tokens)."""
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            stamp = row["TIMESTAMP"].strip()
            head, _, frac = stamp.partition(".")
            t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{frac or 0}")
            times.append(t)
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    t0 = min(times)
    return np.array(times) - t0, np.array(prompts), np.array(outputs)

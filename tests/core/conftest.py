from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"


@pytest.fixture(scope="session")
def perf_csv() -> Path:
    return SHARED / "reference" / "splitwise_perf_llama2_70b.csv"


@pytest.fixture(scope="session")
def azure_trace() -> Path:
    return SHARED / "traces" / "azure_llm_2023_conv.csv"

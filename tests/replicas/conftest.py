"""The small reference model of tests/e2e, and the token streams an uninterrupted run of its
sessions produces (only at the one length these tests stream)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL, model_dir
from tests.e2e.test_moves import TOKENS
from tests.fleet_checks import reference_streams

__all__ = ["model_dir", "reference_tokens"]


@pytest.fixture(scope="session")
def reference_tokens(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, list[int]]]:
    port_file = tmp_path_factory.mktemp("ref") / "port"
    return reference_streams(model_dir, port_file, MODEL, (TOKENS,), graceful=False)

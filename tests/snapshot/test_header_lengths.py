"""A safetensors header of any length is read as one, never mistaken for a pickle stream.

A header 640, 896, 1152 or 1408 bytes long starts with the bytes 0x80 0x02-0x05, which is
also how a pickle stream (protocols 2-5) starts. The failover test found it: a warm move's KV
file whose header came out 896 bytes long was refused as "a pickle stream".
"""

from __future__ import annotations

import pickle

import pytest
import torch

from fleetshift_agent.snapshot.tensorfile import TensorFileError, parse_header, plan


def header_of_length(length: int) -> tuple[bytes, int]:
    for k in range(1, 2000):
        tensors = {"k" * k: torch.zeros(4, dtype=torch.float32)}
        header, _ = plan(tensors)
        if int.from_bytes(header[:8], "little") == length:
            return header, len(header) + 16
    raise AssertionError(f"no header of {length} bytes")


@pytest.mark.parametrize("length", [640, 896, 1152, 1408])
def test_headers_that_start_like_a_pickle_are_read(length: int) -> None:
    header, size = header_of_length(length)
    assert header[0] == 0x80 and header[1] in (2, 3, 4, 5)  # the bytes a pickle starts with
    start, entries = parse_header(header, size)
    assert start == len(header) and [e.shape for e in entries] == [(4,)]


def test_a_real_pickle_is_still_refused() -> None:
    blob = pickle.dumps({"a": 1}, protocol=4)
    with pytest.raises(TensorFileError, match="pickle stream"):
        parse_header(blob, len(blob))

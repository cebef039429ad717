"""The carried inductor kernels: what goes in, and that unpacking cannot escape the cache."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from fleetshift_agent.engine.compile_cache import install_kernels, kernel_archive


def _tree(root: Path) -> None:
    (root / "ab").mkdir(parents=True)
    (root / "ab" / "kernel.so").write_bytes(b"\x7fELF built kernel")
    (root / "ab" / "kernel.cpp").write_text("// source")
    (root / "locks").mkdir()
    (root / "locks" / "x.lock").write_text("")
    (root / "precompiled_headers").mkdir()
    (root / "precompiled_headers" / "big.h.gch").write_bytes(b"0" * 1000)


def test_archive_carries_kernels_but_not_locks_or_precompiled_headers(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src)
    data = kernel_archive(src)
    assert data is not None
    install_kernels(data, dst)
    files = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert files == ["ab/kernel.cpp", "ab/kernel.so"]
    assert (dst / "ab" / "kernel.so").read_bytes() == b"\x7fELF built kernel"


def test_install_never_replaces_a_local_file(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src)
    (dst / "ab").mkdir(parents=True)
    (dst / "ab" / "kernel.so").write_bytes(b"local")
    install_kernels(kernel_archive(src) or b"", dst)
    assert (dst / "ab" / "kernel.so").read_bytes() == b"local"


def test_an_archive_reaching_outside_the_cache_is_refused(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        payload = b"escaped"
        info = tarfile.TarInfo("../outside.so")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "cache").mkdir()
    with pytest.raises(tarfile.FilterError):
        install_kernels(buf.getvalue(), tmp_path / "cache")
    assert not (tmp_path / "outside.so").exists()

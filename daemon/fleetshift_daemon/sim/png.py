"""A minimal line-chart writer (PNG via zlib + struct), because no plotting library is installed.

The project may not add matplotlib, yet a benchmark of a placement policy is read from its
curves. This draws only what the simulator's report needs (axes with numeric ticks, polylines,
vertical move markers, a legend) with a built-in 3x5 pixel font. Every plot's data is also
written as CSV, so a proper plotting tool can redraw it.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111",
    "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101",
    "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011",
    "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101",
    "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    " ": "000000000000000", ".": "000000000000010", ",": "000000000010100",
    "-": "000000111000000", ":": "000010000010000", "/": "001001010100100",
    "%": "101001010100101", "(": "001010010010001", ")": "100010010010100",
    "_": "000000000000111", "=": "000111000111000", "+": "000010111010000",
    ">": "100010001010100", "<": "001010100010001", "$": "011110010011110",
    "?": "111001010000010",
}  # fmt: skip
PALETTE = [
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127),
]  # fmt: skip
_SCALE = 2
_W, _H = 900, 520
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 200, 40, 60


@dataclass(frozen=True)
class Series:
    label: str
    x: Sequence[float] | npt.NDArray[np.float64]
    y: Sequence[float] | npt.NDArray[np.float64]


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.px: npt.NDArray[np.uint8] = np.full((height, width, 3), 255, dtype=np.uint8)

    def dot(self, x: int, y: int, color: tuple[int, int, int], r: int = 0) -> None:
        h, w, _ = self.px.shape
        self.px[max(0, y - r) : min(h, y + r + 1), max(0, x - r) : min(w, x + r + 1)] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int]) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n + 1):
            f = i / n
            self.dot(round(x0 + (x1 - x0) * f), round(y0 + (y1 - y0) * f), color, r=1)

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = (0, 0, 0)) -> None:
        for ch in s.upper():
            glyph = _GLYPHS.get(ch, _GLYPHS["?"])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    gx, gy = x + (i % 3) * _SCALE, y + (i // 3) * _SCALE
                    self.px[gy : gy + _SCALE, gx : gx + _SCALE] = color
            x += 4 * _SCALE

    def save(self, path: Path) -> None:
        h, w, _ = self.px.shape
        raw = b"".join(b"\x00" + self.px[row].tobytes() for row in range(h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            body = tag + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        head = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head)
        png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        path.write_bytes(png)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def line_chart(
    path: Path,
    title: str,
    series: Sequence[Series],
    xlabel: str,
    ylabel: str,
    markers: Sequence[float] = (),
    marker_label: str = "",
) -> None:
    """Write a PNG line chart; ``markers`` are x positions drawn as short red ticks on top."""
    xs = [float(v) for s in series for v in s.x if math.isfinite(v)]
    ys = [float(v) for s in series for v in s.y if math.isfinite(v)]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    y0, y1 = (min(0.0, min(ys)), max(ys) * 1.05) if ys else (0.0, 1.0)
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1
    c = Canvas(_W, _H)
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def sx(v: float) -> float:
        return _LEFT + (v - x0) / (x1 - x0) * pw

    def sy(v: float) -> float:
        return _TOP + ph - (v - y0) / (y1 - y0) * ph

    grey = (200, 200, 200)
    for t in _ticks(x0, x1):
        c.line(sx(t), _TOP, sx(t), _TOP + ph, grey)
        c.text(int(sx(t)) - 10, _TOP + ph + 8, _fmt(t))
    for t in _ticks(y0, y1):
        c.line(_LEFT, sy(t), _LEFT + pw, sy(t), grey)
        c.text(8, int(sy(t)) - 5, _fmt(t))
    c.line(_LEFT, _TOP + ph, _LEFT + pw, _TOP + ph, (0, 0, 0))
    c.line(_LEFT, _TOP, _LEFT, _TOP + ph, (0, 0, 0))
    for m in markers:
        c.line(sx(m), _TOP, sx(m), _TOP + 14, (214, 39, 40))
    for k, s in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        pts = [(sx(a), sy(b)) for a, b in zip(s.x, s.y, strict=True) if math.isfinite(b)]
        for (a0, b0), (a1, b1) in itertools.pairwise(pts):
            c.line(a0, b0, a1, b1, color)
        c.dot(_W - _RIGHT + 16, _TOP + 10 + 20 * k, color, r=4)
        c.text(_W - _RIGHT + 28, _TOP + 5 + 20 * k, s.label[:20])
    if markers and marker_label:
        k = len(series)
        c.line(
            _W - _RIGHT + 16, _TOP + 2 + 20 * k, _W - _RIGHT + 16, _TOP + 16 + 20 * k, (214, 39, 40)
        )
        c.text(_W - _RIGHT + 28, _TOP + 5 + 20 * k, marker_label[:20])
    c.text(_LEFT, 6, title[:90])
    c.text(_LEFT + pw // 2 - 4 * len(xlabel), _H - 24, xlabel)
    c.text(8, _TOP - 16, ylabel[:30])
    c.save(path)

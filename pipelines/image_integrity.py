"""Whether a PNG or JPEG file holds its whole image, checked as its image decodes (:mod:`pipelines.images`).

ffmpeg's decoders conceal damage rather than fail: a PNG whose image data stops before its last row (a file cut at
its end, a stream that ends early) decoded with the missing rows filled, and a JPEG cut short with its last blocks
grey, so a damaged start image was taken as the world's picture without a word. Here a PNG's chunks are read to its
``IEND`` (each critical chunk's CRC checked) and its image data inflated in full and counted against the rows its
header gives; a JPEG's segments and scans are walked to its end-of-image marker.
"""

from __future__ import annotations

import struct
import zlib
from typing import Final

__all__ = ["cut_short"]

_PNG_SIGNATURE: Final = b"\x89PNG\r\n\x1a\n"
_CHANNELS: Final = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # PNG colour type -> samples per pixel
#: Adam7's passes: (first column, first row, column step, row step)
_ADAM7: Final = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def cut_short(data: bytes, image_format: str) -> str | None:
    """What is missing or damaged in ``data``, a ``png`` or ``jpeg`` file whose header was read, or None when it is
    whole (or another format, which its decoder alone checks)."""
    if image_format == "png":
        return _png_problem(data)
    if image_format == "jpeg":
        return _jpeg_problem(data)
    return None


def _png_image_bytes(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> int:
    """The bytes of filtered image data (a filter byte per row) a PNG of that size holds."""
    def rows(pass_width: int, pass_height: int) -> int:
        return 0 if pass_width == 0 or pass_height == 0 else pass_height * (1 + (pass_width * bits_per_pixel + 7) // 8)

    if not interlaced:
        return rows(width, height)
    return sum(rows((width - x + dx - 1) // dx, (height - y + dy - 1) // dy) for x, y, dx, dy in _ADAM7)


def _png_problem(data: bytes) -> str | None:
    at, header, image = len(_PNG_SIGNATURE), None, []
    while True:
        if at + 8 > len(data):
            return "the file ends before its IEND chunk"
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        end = at + 12 + length
        if end > len(data):
            return f"the file ends inside its {kind.decode('latin-1')!r} chunk"
        body = data[at + 8 : end - 4]
        if kind[0:1].isupper() and zlib.crc32(kind + body) != struct.unpack(">I", data[end - 4 : end])[0]:
            return f"its {kind.decode('latin-1')!r} chunk's CRC does not match"
        if kind == b"IHDR" and length >= 13:
            header = struct.unpack(">IIBBBBB", body[:13])
        elif kind == b"IDAT":
            image.append(body)
        elif kind == b"IEND":
            break
        at = end
    if header is None:
        return "it has no IHDR chunk"
    width, height, depth, colour, _, _, interlace = header
    expected = _png_image_bytes(width, height, depth * _CHANNELS.get(colour, 1), interlace == 1)
    inflate = zlib.decompressobj()
    try:
        held = len(inflate.decompress(b"".join(image), expected))
    except zlib.error as exc:
        return f"its image data is corrupt ({exc})"
    if held < expected:
        return f"its image data stops short of the {width} x {height} pixels its header gives: {held} of {expected} bytes"
    return None


def _jpeg_problem(data: bytes) -> str | None:
    at = 2  # past SOI
    while True:
        marker_at = data.find(b"\xff", at)
        if marker_at < 0 or marker_at + 1 >= len(data):
            return "the file ends before its end-of-image marker"
        marker = data[marker_at + 1]
        if marker in (0x00, 0xFF) or 0xD0 <= marker <= 0xD7:  # stuffed byte, fill, restart: inside a scan
            at = marker_at + 1 if marker == 0xFF else marker_at + 2
            continue
        if marker == 0xD9:
            return None
        if marker_at + 4 > len(data):
            return "the file ends inside a segment"
        (length,) = struct.unpack(">H", data[marker_at + 2 : marker_at + 4])
        at = marker_at + 2 + length
        if at > len(data):
            return "the file ends inside a segment"

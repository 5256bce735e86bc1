"""``chunkline run --image`` of a PNG or JPEG cut short is bad input: exit 2, naming the file and what is missing.

ffmpeg's decoders conceal damage: a PNG cut before its ``IEND``, or whose image data stops before its last row, and a
JPEG cut short decoded with the missing part filled, and the toy world took the result as its picture (exit 0). The
decoder (:func:`pipelines.images.load_image`; :func:`pipelines.images.check_decodes`, a create's check) now reads
such a file whole and refuses it, and the toy world's create refuses the image as bad input.
"""

from __future__ import annotations

import fractions
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import pytest

from ..server.conftest import png_bytes
from .cli_runs import ROOT, failed_line, run_pipeline


def _short_image_data() -> bytes:
    """A well-formed 8 x 8 PNG whose image data holds 4 of its 8 rows (its zlib stream and every CRC whole)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)
    rows = zlib.compress((b"\0" + b"\x80" * 24) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def _jpeg_bytes() -> bytes:
    codec = av.CodecContext.create("mjpeg", "w")
    codec.width, codec.height, codec.pix_fmt, codec.time_base = 64, 48, "yuvj420p", fractions.Fraction(1, 25)
    y, x = np.mgrid[0:48, 0:64]
    pixels = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)
    frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuvj420p")
    return b"".join(bytes(packet) for packet in [*codec.encode(frame), *codec.encode(None)])


@pytest.mark.parametrize(
    ("name", "make", "told"),
    [
        ("cut.png", lambda: png_bytes(16, 16)[:-12], "the file ends before its IEND chunk"),
        ("rows.png", _short_image_data,
         "its image data stops short of the 8 x 8 pixels its header gives: 100 of 200 bytes"),
        ("cut.jpg", lambda: _jpeg_bytes()[:-40], "the file ends before its end-of-image marker"),
    ],
    ids=["png_without_its_end", "png_rows_missing", "jpeg_cut_short"],
)
def test_an_image_cut_short_is_bad_input_naming_the_file(
    tmp_path: Path, name: str, make: Callable[[], bytes], told: str
) -> None:
    image = tmp_path / name
    image.write_bytes(make())
    ran = run_pipeline(tmp_path, ROOT / "pipelines" / "toy_world", "--image", str(image), chunks=1)
    assert failed_line(ran, code=2) == (
        f"chunkline run: the pipeline refused the session: image {name!r}: the image does not decode whole, it is truncated or corrupt: {told}")

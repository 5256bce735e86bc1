"""``chunkline run pipelines/toy_world --image`` of an image under 2 x 2 pixels is bad input: exit 2, naming the image.

The session was created and its encode stage failed it (``the run failed: the pipeline failed making chunk 0:
PipelineFailed: ... at least 2 x 2``, exit 1, as if the pipeline had failed).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from .cli_runs import ROOT, failed_line, run_pipeline


def _png(path: Path, width: int, height: int) -> None:
    """A black RGB PNG of ``width`` x ``height``."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress((b"\0" + b"\0" * 3 * width) * height)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))


@pytest.mark.parametrize(("width", "height"), [(1, 1), (40, 1), (1000, 1), (1, 3000)])
def test_an_image_under_two_by_two_pixels_is_bad_input(tmp_path: Path, width: int, height: int) -> None:
    """The size said is the file's own, not the size its pixels are scaled down to as they are read (a 1000 x 1
    image was said to be 320 x 1, a 1 x 3000 one 1 x 192)."""
    image = tmp_path / "dot.png"
    _png(image, width, height)
    ran = run_pipeline(tmp_path, ROOT / "pipelines" / "toy_world", "--image", str(image), chunks=1)
    assert failed_line(ran, code=2) == (
        f"chunkline run: the pipeline refused the session: image 'dot.png' is {width} x {height} pixels; the toy world "
        "takes one of at least 2 x 2")

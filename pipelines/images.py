"""Reference images: their dimensions read from the file header before anything is decoded.

A compressed image of a few kilobytes can decode to gigabytes of pixels (a 60000 x 60000 PNG of
one colour compresses to almost nothing). :func:`check_image` reads the format and size from the
first bytes of PNG, JPEG, GIF, BMP and WebP files and refuses, with an :class:`ImageRefused`
naming the limit, any image larger than :data:`MAX_IMAGE_SIDE` per side or :data:`MAX_IMAGE_PIXELS`
in all, and any file whose header is not one of those formats. Only then may a decoder run:
:func:`load_image` checks the header, decodes the first frame, and scales an image larger than the
model can use down to that size as it converts it, so no more pixels are kept than the model's. A PNG or JPEG
cut short is refused as it decodes, not concealed (:mod:`pipelines.image_integrity`).
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import BinaryIO, Final

import attrs
import numpy as np

from .image_integrity import cut_short
from .paths import open_regular_file

__all__ = [
    "HEADER_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "ImageInfo",
    "ImageRefused",
    "check_image",
    "check_decodes",
    "check_image_file",
    "load_image",
    "load_image_sized",
]

MAX_IMAGE_SIDE: Final = 8192
MAX_IMAGE_PIXELS: Final = 4096 * 4096
HEADER_BYTES: Final = 1 << 20  # a JPEG's size may follow large metadata segments; it must appear within this


class ImageRefused(ValueError):
    """An image that will not be decoded, or did not; ``reason`` is ``unsupported_image``, ``image_too_large`` or
    ``unreadable_image``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@attrs.frozen
class ImageInfo:
    format: str
    width: int
    height: int


def _png(data: bytes) -> tuple[int, int] | None:
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    return None


def _gif(data: bytes) -> tuple[int, int] | None:
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    return None


def _bmp(data: bytes) -> tuple[int, int] | None:
    if data[:2] == b"BM" and len(data) >= 26:
        width, height = struct.unpack("<ii", data[18:26])
        return abs(width), abs(height)
    return None


def _webp(data: bytes) -> tuple[int, int] | None:
    """The largest size any of the file's headers declares: an extended file's canvas (``VP8X``) may say 100 x 100
    over a bitstream (``VP8L``, ``VP8 ``, a frame's ``ANMF``) that decodes at 16000 x 16000, and the decoder makes
    the bitstream's (50 bytes decoded to 1 GB). None when no image data is found in ``data``."""
    if data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    sizes = _webp_sizes(data, 12)
    if not sizes or not any(kind != b"VP8X" for kind, _ in sizes):  # a canvas alone: its image is not in the head
        return None
    return max(size[0] for _, size in sizes), max(size[1] for _, size in sizes)


def _webp_sizes(data: bytes, at: int, depth: int = 0) -> list[tuple[bytes, tuple[int, int]]]:
    """The sizes declared by the chunks from ``at`` on (an animation frame's chunks within it, once)."""
    found: list[tuple[bytes, tuple[int, int]]] = []
    while at + 8 <= len(data):
        kind = data[at : at + 4]
        length = int.from_bytes(data[at + 4 : at + 8], "little")
        payload = data[at + 8 : at + 8 + length]
        if kind == b"VP8X" and len(payload) >= 10:
            found.append((kind, (_side(payload[4:7]), _side(payload[7:10]))))
        elif kind == b"VP8L" and len(payload) >= 5 and payload[0] == 0x2F:
            bits = int.from_bytes(payload[1:5], "little")
            found.append((kind, (1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF))))
        elif kind == b"VP8 " and len(payload) >= 10 and payload[3:6] == b"\x9d\x01\x2a":
            width, height = struct.unpack("<HH", payload[6:10])
            found.append((kind, (width & 0x3FFF, height & 0x3FFF)))
        elif kind == b"ANMF" and len(payload) >= 16 and depth == 0:
            found.append((kind, (_side(payload[6:9]), _side(payload[9:12]))))
            found += _webp_sizes(payload, 16, depth + 1)
        at += 8 + length + (length & 1)
    return found


def _side(field: bytes) -> int:
    """A WebP canvas or frame side: 24 bits, little-endian, one less than the side."""
    return 1 + int.from_bytes(field, "little")


_SOF_MARKERS: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg(data: bytes) -> tuple[int, int] | None:
    if data[:2] != b"\xff\xd8":
        return None
    at = 2
    sizes: list[tuple[int, int]] = []
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        if marker in _SOF_MARKERS:
            if at + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            sizes.append((width, height))
        if marker == 0xDA or length < 2:  # the scan's coded data follows: no more segments to walk
            break
        at += 2 + length
    if not sizes:
        return None
    # every frame header before the scan, the largest: a second one, larger, was the decoder's (as a WebP's bitstream)
    return max(width for width, _ in sizes), max(height for _, height in sizes)


_FORMATS: Final = (("png", _png), ("jpeg", _jpeg), ("gif", _gif), ("bmp", _bmp), ("webp", _webp))


def check_image(data: bytes, *, max_side: int = MAX_IMAGE_SIDE, max_pixels: int = MAX_IMAGE_PIXELS) -> ImageInfo:
    """The format and size of an image from its first bytes, or :class:`ImageRefused`."""
    head = bytes(data[:HEADER_BYTES])
    for name, read in _FORMATS:
        size = read(head)
        if size is None:
            continue
        width, height = size
        if width < 1 or height < 1:
            raise ImageRefused("unsupported_image", f"the {name.upper()} header gives an empty size {width} x {height}")
        if width > max_side or height > max_side or width * height > max_pixels:
            raise ImageRefused(
                "image_too_large",
                f"the image is {width} x {height} pixels; at most {max_side} per side and {max_pixels} pixels "
                f"in all are decoded (MAX_IMAGE_SIDE, MAX_IMAGE_PIXELS)",
            )
        return ImageInfo(name, width, height)
    raise ImageRefused("unsupported_image", "the image is not a PNG, JPEG, GIF, BMP or WebP file (or its header is cut short)")


def check_image_file(path: str | Path, **limits: int) -> ImageInfo:
    """:func:`check_image` on the first :data:`HEADER_BYTES` of a file."""
    with os.fdopen(open_regular_file(path), "rb") as file:
        return check_image(file.read(HEADER_BYTES), **limits)


def load_image(path: str | Path, max_size: tuple[int, int]) -> np.ndarray:
    """An image file as ``H x W x 3`` uint8, no larger than ``max_size`` (height, width); ``ValueError``
    (naming the file by its name only) when it is missing, refused by its header or unreadable."""
    return load_image_sized(path, max_size)[0]


def load_image_sized(path: str | Path, max_size: tuple[int, int]) -> tuple[np.ndarray, ImageInfo]:
    """:func:`load_image`, with the format and size of the file itself (its header's): the pixels may be scaled
    down, and a check of the image's size names the size of the file the user gave, not the scaled one (a 1000 x 1
    image was said to be 320 x 1)."""
    file = Path(path)
    if not file.exists():
        raise ValueError(f"image {file.name!r} does not exist")
    try:
        info = check_image_file(file)  # refused by its header before the whole file is read
        with os.fdopen(open_regular_file(file), "rb") as opened:
            return _first_frame(opened, max_size), info
    except ImageRefused as exc:
        raise ValueError(f"image {file.name!r}: {exc.detail}") from exc
    except OSError as exc:  # swapped since it was named: a pipe, a link, gone
        raise ValueError(f"image {file.name!r} cannot be read: {exc.strerror or exc}") from None


def check_decodes(source: bytes | str | Path) -> None:
    """Decode an image whose header :func:`check_image` took (its bytes, or its file) as :func:`load_image` will,
    and drop the pixels: a header can be whole over pixel data that is not. :class:`ImageRefused`
    (``unreadable_image``) when it does not decode."""
    if isinstance(source, bytes):
        _first_frame(io.BytesIO(source), (1, 1))
        return
    try:
        with os.fdopen(open_regular_file(source), "rb") as opened:
            _first_frame(opened, (1, 1))
    except OSError as exc:
        raise ImageRefused("unreadable_image", f"the image cannot be read: {exc.strerror or exc}") from None


def _first_frame(source: BinaryIO, max_size: tuple[int, int]) -> np.ndarray:
    """The first frame as RGB, scaled down to fit ``max_size`` (height, width); ImageRefused when it does not decode,
    or when its file is cut short or damaged where ffmpeg would conceal it (:mod:`pipelines.image_integrity`)."""
    import av

    data = source.read()
    problem = cut_short(data, check_image(data).format)
    if problem is not None:  # ffmpeg filled what is missing, and the image was taken
        raise ImageRefused("unreadable_image", f"the image does not decode whole, it is truncated or corrupt: {problem}")
    try:
        with av.open(io.BytesIO(data)) as container:
            frame = next(container.decode(video=0))
            height, width = max_size
            if frame.height > height or frame.width > width:
                return frame.to_ndarray(width=min(width, frame.width), height=min(height, frame.height), format="rgb24")
            return frame.to_ndarray(format="rgb24")
    except (av.FFmpegError, StopIteration, OSError) as exc:
        raise ImageRefused("unreadable_image", "the image does not decode (its pixel data is damaged or cut short)") from exc

"""A strip of frames from an offline run's video, as a PNG (the README's picture of the toy world).

``python -m pipelines.toy_world.strip RUN_DIR/video.mp4 docs/toy_world_strip.png [--frames 6] [--scale 1]``
decodes the video (PyAV), takes ``--frames`` frames evenly spaced from the first to the last, puts
them side by side with a 2-pixel gap and writes an 8-bit RGB PNG (zlib; no imaging library needed).
"""

from __future__ import annotations

import argparse
import struct
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["frame_strip", "read_video_frames", "write_png"]


def write_png(path: str | Path, image: np.ndarray) -> None:
    """Write an ``H x W x 3`` uint8 image as a PNG."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be H x W x 3 uint8, got {image.shape} {image.dtype}")
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    )


def read_video_frames(path: str | Path) -> list[np.ndarray]:
    """Every frame of a video file as ``H x W x 3`` uint8."""
    import av

    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def frame_strip(frames: Sequence[np.ndarray], count: int, scale: int = 1, gap: int = 2) -> np.ndarray:
    """``count`` frames evenly spaced over ``frames`` (first and last included), side by side."""
    if count < 1 or len(frames) < 1:
        raise ValueError(f"need at least one frame and count >= 1, got {len(frames)} frames, count {count}")
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    chosen = [np.repeat(np.repeat(frames[i], scale, axis=0), scale, axis=1) for i in picks]
    height = chosen[0].shape[0]
    spacer = np.full((height, gap, 3), 255, dtype=np.uint8)
    parts: list[np.ndarray] = []
    for frame in chosen:
        parts += [frame, spacer]
    return np.concatenate(parts[:-1], axis=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.toy_world.strip", description=__doc__.split("\n")[0])
    parser.add_argument("video")
    parser.add_argument("out")
    parser.add_argument("--frames", type=int, default=6)
    parser.add_argument("--scale", type=int, default=1)
    args = parser.parse_args(argv)
    frames = read_video_frames(args.video)
    write_png(args.out, frame_strip(frames, args.frames, args.scale))
    print(f"{args.out}: {args.frames} of {len(frames)} frames")
    return 0


if __name__ == "__main__":
    sys.exit(main())

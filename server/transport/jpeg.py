"""Video frames as the local rooms send them: each a baseline JPEG (a browser shows it as it comes)."""

from __future__ import annotations

import fractions

import numpy as np

__all__ = ["encode_jpeg"]


def encode_jpeg(frame: np.ndarray, quality: int = 4) -> bytes:
    """RGB ``H x W x 3`` uint8 to a baseline JPEG (PyAV's mjpeg encoder)."""
    import av

    height, width = frame.shape[:2]
    context = av.CodecContext.create("mjpeg", "w")
    context.width = width - width % 2
    context.height = height - height % 2
    context.pix_fmt = "yuvj420p"
    context.time_base = fractions.Fraction(1, 30)
    context.options = {"qscale": str(quality)}
    video = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[: context.height, : context.width]), format="rgb24")
    packets = context.encode(video.reformat(format="yuvj420p")) + context.encode(None)
    return b"".join(bytes(p) for p in packets)

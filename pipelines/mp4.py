"""Writing chunks to an H.264 mp4 with PyAV (blocking: run it on a worker thread).

The video runs at the chunks' fps, refused when the mp4 cannot hold it (below 1/1001 or above a million frames a
second), as are frames over 16384 pixels a side; odd frame sizes are padded to even by repeating the edge; PCM16 audio is encoded
as AAC when the first chunk carries audio, and later chunks without audio get silence.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .contract import Chunk

__all__ = ["Mp4Writer", "StreamChanged"]

#: the frame rates the video takes: a fraction with a denominator up to 1001 (30000/1001) within 0.1 % of the chunks'
#: fps, up to a million a second (1e10 failed the run as ``OverflowError: value too large to convert to int``)
MAX_DENOMINATOR = 1001
MAX_FPS = 1_000_000
#: the widest and tallest frame the encoder takes (2 x 16386 failed the run as ``Generic error in an external
#: library: 'avcodec_open2("libx264", ...)'``, naming neither the frames nor their size)
MAX_SIDE = 16384


def _frame_rate(fps: float, index: int) -> Fraction:
    """The video's frame rate for chunks at ``fps``; a ``ValueError`` naming it when the mp4 cannot hold it. One below
    1/2002 rounded to 0, which the encoder took as 24 fps, and the run exited 0 with a video at the wrong speed."""
    rate = Fraction(fps).limit_denominator(MAX_DENOMINATOR)
    if rate <= 0 or rate > MAX_FPS or abs(float(rate) - fps) > fps * 1e-3:
        raise ValueError(f"chunk {index}: fps {fps:g} cannot be the video's frame rate (it takes 1/{MAX_DENOMINATOR} "
                         f"to {MAX_FPS} frames a second)")
    return rate


def _check_audio(sample_rate: int, channels: int, index: int) -> None:
    """A ``ValueError`` naming what of a chunk's audio the mp4's AAC cannot take: a rate off its list (12345 Hz, 192 kHz
    failed the run as ``Invalid argument: 'avcodec_open2("aac", {})' returned 22``) or more than 2 channels."""
    import av

    rates = sorted(av.codec.Codec("aac", "w").audio_rates or ())
    if rates and sample_rate not in rates:
        raise ValueError(f"chunk {index}: audio sample_rate {sample_rate} Hz cannot be encoded as AAC (it takes "
                         f"{', '.join(map(str, rates))} Hz)")
    _layout(channels)


def _layout(channels: int) -> str:
    if channels == 1:
        return "mono"
    if channels == 2:
        return "stereo"
    raise ValueError(f"audio with {channels} channels is not supported in the mp4 (1 or 2)")


class StreamChanged(ValueError):
    """A chunk whose fps, frame size or audio format is not the first chunk's: one video file keeps them."""


class Mp4Writer:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._container: Any = None
        self._video: Any = None
        self._audio: Any = None
        self._shape: tuple[int, int] | None = None
        self._fps: float | None = None
        self._frames = 0
        self._samples = 0
        self._audio_format: tuple[int, int] | None = None
        self.audio_dropped_chunks = 0
        self.audio_silent_chunks = 0

    def _open(self, chunk: Chunk) -> None:
        import av

        height, width = chunk.frames.shape[1:3]
        if max(width + width % 2, height + height % 2) > MAX_SIDE:
            raise ValueError(f"chunk {chunk.index}: frames of {width} x {height} pixels are larger than the video "
                             f"takes (at most {MAX_SIDE} per side)")
        rate = _frame_rate(chunk.fps, chunk.index)
        if chunk.audio is not None:
            _check_audio(chunk.audio.sample_rate, chunk.audio.channels, chunk.index)
        self._shape = (height, width)
        self._fps = chunk.fps
        self._container = av.open(str(self.path), "w", format="mp4")
        self._video = self._container.add_stream("libx264", rate=rate)
        self._video.width = width + width % 2
        self._video.height = height + height % 2
        self._video.pix_fmt = "yuv420p"
        self._video.codec_context.options = {"preset": "veryfast"}
        if chunk.audio is not None:
            audio = chunk.audio
            self._audio = self._container.add_stream("aac", rate=audio.sample_rate, layout=_layout(audio.channels))
            self._audio_format = (audio.sample_rate, audio.channels)

    def write(self, chunk: Chunk) -> None:
        import av

        if self._container is None:
            self._open(chunk)
        if chunk.frames.shape[1:3] != self._shape:
            (height, width), (first_height, first_width) = chunk.frames.shape[1:3], self._shape  # type: ignore[misc]
            raise StreamChanged(f"chunk {chunk.index} changes the frame size from {first_width} x {first_height} to "
                                f"{width} x {height}")
        if not math.isclose(chunk.fps, self._fps or 0.0, rel_tol=1e-9):
            raise StreamChanged(f"chunk {chunk.index} changes the fps from {self._fps:g} to {chunk.fps:g}")
        frames = chunk.frames
        pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
        if pad_h or pad_w:
            frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts = self._frames
            self._frames += 1
            self._container.mux(self._video.encode(frame))
        if self._audio is None:
            if chunk.audio is not None:
                self.audio_dropped_chunks += 1
            return
        sample_rate, channels = self._audio_format  # type: ignore[misc]
        if chunk.audio is None:
            self.audio_silent_chunks += 1
            pcm = np.zeros(round(chunk.media_seconds * sample_rate) * channels, dtype="<i2")
        else:
            if (chunk.audio.sample_rate, chunk.audio.channels) != self._audio_format:
                raise StreamChanged(
                    f"chunk {chunk.index} changes the audio format from {sample_rate} Hz x {channels} to "
                    f"{chunk.audio.sample_rate} Hz x {chunk.audio.channels}"
                )
            pcm = np.frombuffer(chunk.audio.pcm, dtype="<i2")
        if pcm.size == 0:
            return
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=_layout(channels))
        frame.sample_rate = sample_rate
        frame.pts = self._samples
        self._samples += pcm.size // channels
        self._container.mux(self._audio.encode(frame))

    def finish(self) -> None:
        if self._container is None:
            raise RuntimeError("the pipeline produced no chunks; nothing to write")
        self._container.mux(self._video.encode())
        if self._audio is not None:
            self._container.mux(self._audio.encode())
        self._container.close()
        self._container = None

    def abort(self) -> None:
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # the file is deleted anyway
                pass
            self._container = None

    def audio_info(self) -> dict[str, Any] | None:
        if self._audio_format is None:
            return None
        sample_rate, channels = self._audio_format
        return {"sample_rate": sample_rate, "channels": channels, "seconds": self._samples / sample_rate}

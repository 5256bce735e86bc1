"""The replay pipeline: a server-push service that streams a test pattern or a video file, with a tone.

Request options (``SessionConfig.options``; anything else is refused with a ``ValueError`` naming it):

==================  =======  ============================================================================
option              default  meaning
==================  =======  ============================================================================
``fps``             16       frames per second of the stream (a number, 0 < fps <= 240)
``width``           320      frame width in pixels (an even int, 16..4096; even so it encodes as yuv420p)
``height``          192      frame height in pixels (an even int, 16..4096)
``frames_per_chunk`` 8       frames in each chunk (an int, 1..1024)
``duration_seconds`` 10      how long the stream runs (a number > 0, at most one day)
``tone_hz``         440      frequency of the sine tone (0 <= tone_hz < 24000; 0 is silence)
``video_path``      None     a video file to replay instead of the test pattern (decoded with PyAV)
==================  =======  ============================================================================

A chunk holds at most ``MAX_CHUNK_BYTES`` (64 MiB) of frames (``width x height x 3 x frames_per_chunk``) and audio
(``frames_per_chunk / fps`` seconds of 16-bit samples at 48 kHz) together, and its tone is made a block of
``TONE_BLOCK`` samples at a time, so no request can make the service hold more than that per chunk (the audio was
not counted: ``fps`` 0.05 with 1,024 frames a chunk of 16 x 16 asked for 5.7 hours of audio, some 8 GB made at once,
and ``fps`` 1e-300 failed the session with numpy's ``Maximum allowed size exceeded``). Where ``video_path`` may point is the
service's ``videos``: any file (``ANY_FILE``, offline runs, where the user names their own files), only files
inside a directory (relative names, no ``..``, no symlinks out: the stream server's ``--assets-dir``, since
its clients are remote), or none at all (``None``: a server without an assets directory).

The stream is bounded: ``ceil(duration_seconds * fps / frames_per_chunk)`` chunks of ``frames_per_chunk``
frames each. With ``video_path`` it also ends when the video does; its last chunk then holds the frames that
were left (fewer than ``frames_per_chunk``). Video frames are sampled at the stream's fps (the latest source
frame at or before each output frame's time) and resized to ``width`` x ``height`` by nearest neighbour.

Every chunk carries :class:`~pipelines.contract.Audio`: PCM16, 48 kHz, mono, a sine tone whose phase runs on
across chunks, exactly as long as the chunk's frames (``frames / fps`` seconds; sample boundaries are
``round(frame * 48000 / fps)``, so the sum over chunks never drifts from the video).

The test pattern is a colour gradient (red across, green down, blue cycling with time), a white square
bouncing left and right, a dark disc on a sine path, and the stream's frame number drawn in block digits in the
top-left corner, so every frame differs visibly from the one before.

Session inputs: the stream depends on its options only; the service takes no prompt and no image
(``takes_prompt = takes_image = False``), so a request that gives either is refused, never served without it.

Single session: a :class:`~pipelines.contract.ServerPushService` has exactly one retained session by contract,
so the service serves one stream at a time; calling :meth:`ReplayService.stream` while a stream is open raises
``RuntimeError``. The caller paces the chunks (the generator produces them as fast as they are pulled).
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from numbers import Real
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

from pipelines.contract import Audio, Chunk, ServerPushService, SessionConfig
from pipelines.json_objects import as_json
from pipelines.paths import NO_SUCH_FILE, PathRefused, regular_file_problem, resolve_inside

__all__ = ["ANY_FILE", "MAX_CHUNK_BYTES", "SAMPLE_RATE", "ReplayOptions", "ReplayService", "render_test_pattern", "tone_pcm"]

SAMPLE_RATE = 48000
MAX_CHUNK_BYTES = 64 * 1024 * 1024
#: samples of the tone made at once
TONE_BLOCK = 1 << 16


class _AnyFile:
    def __repr__(self) -> str:
        return "ANY_FILE"


#: ``videos`` that lets ``video_path`` name any file (a local user's own run)
ANY_FILE: Any = _AnyFile()
_AMPLITUDE = 0.25 * 32767

# 3 x 5 block glyphs for the frame counter.
_GLYPHS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
}
_GLYPH_MASKS = {d: np.array([[c == "#" for c in row] for row in rows], dtype=bool) for d, rows in _GLYPHS.items()}


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen
class ReplayOptions:
    """Validated request options (see the module docstring)."""

    fps: float = 16.0
    width: int = 320
    height: int = 192
    frames_per_chunk: int = 8
    duration_seconds: float = 10.0
    tone_hz: float = 440.0
    video_path: str | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any], videos: str | None = ANY_FILE) -> ReplayOptions:
        """``videos``: where ``video_path`` may point (``ANY_FILE``, a directory, or ``None`` for nowhere)."""
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ValueError(f"replay: unknown option(s) {unknown} (known: {sorted(known)})")
        values = {f.name: f.default for f in attrs.fields(cls)}
        values.update(options)
        fps = values["fps"]
        if not _is_real(fps) or not 0 < float(fps) <= 240:
            raise ValueError(f"replay option 'fps' must be a number in (0, 240], got {as_json(fps)}")
        for name in ("width", "height"):
            size = values[name]
            if not _is_int(size) or not 16 <= size <= 4096 or size % 2:
                raise ValueError(f"replay option {name!r} must be an even int in [16, 4096], got {as_json(size)}")
        per_chunk = values["frames_per_chunk"]
        if not _is_int(per_chunk) or not 1 <= per_chunk <= 1024:
            raise ValueError(f"replay option 'frames_per_chunk' must be an int in [1, 1024], got {as_json(per_chunk)}")
        duration = values["duration_seconds"]
        if not _is_real(duration) or not 0 < float(duration) <= 86400:
            raise ValueError(f"replay option 'duration_seconds' must be a number in (0, 86400], got {as_json(duration)}")
        tone = values["tone_hz"]
        if not _is_real(tone) or not 0 <= float(tone) < SAMPLE_RATE / 2:
            raise ValueError(f"replay option 'tone_hz' must be a number in [0, {SAMPLE_RATE // 2}), got {as_json(tone)}")
        chunk_bytes = int(values["width"]) * int(values["height"]) * 3 * per_chunk
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise ValueError(
                f"replay options 'width' x 'height' x 3 x 'frames_per_chunk' make {chunk_bytes} bytes a chunk; "
                f"at most {MAX_CHUNK_BYTES} (lower the size or frames_per_chunk)"
            )
        audio_bytes = _chunk_audio_bytes(per_chunk, float(fps))
        if chunk_bytes + audio_bytes > MAX_CHUNK_BYTES:
            room = (MAX_CHUNK_BYTES - chunk_bytes) / (2 * SAMPLE_RATE)
            raise ValueError(
                f"replay options 'frames_per_chunk' / 'fps' make {per_chunk / float(fps):.6g} s of audio a chunk; a "
                f"chunk holds at most {MAX_CHUNK_BYTES} bytes, which leaves {room:.6g} s of audio beside these frames "
                f"(raise fps or lower frames_per_chunk)"
            )
        video = values["video_path"]
        if video is not None:
            if not isinstance(video, str | os.PathLike) or not str(video):
                raise ValueError(f"replay option 'video_path' must be a file path, got {as_json(video)}")
            video = _video_file(str(video), videos)
        return cls(
            fps=float(fps),
            width=int(values["width"]),
            height=int(values["height"]),
            frames_per_chunk=per_chunk,
            duration_seconds=float(duration),
            tone_hz=float(tone),
            video_path=video,
        )

    @property
    def chunk_count(self) -> int:
        return max(1, math.ceil(self.duration_seconds * self.fps / self.frames_per_chunk - 1e-9))


def _video_file(video: str, videos: str | None) -> str:
    """Where ``video`` may be read from, given the service's ``videos`` (see the module docstring)."""
    if videos is ANY_FILE:
        problem = regular_file_problem(video)  # a directory or a pipe was "no such file"
        if problem == NO_SUCH_FILE:
            raise ValueError(f"replay option 'video_path': no such file {video!r}")
        if problem is not None:
            raise ValueError(f"replay option 'video_path': {video!r} {problem}")
        return video
    if videos is None:
        raise ValueError("replay option 'video_path' needs the server to be started with --assets-dir")
    try:
        return str(resolve_inside(videos, video))
    except PathRefused as exc:
        raise ValueError(f"replay option 'video_path' {exc}") from None


def _sample_at(frame: int, fps: float) -> int:
    return round(frame * SAMPLE_RATE / fps)


def _chunk_audio_bytes(frames: int, fps: float) -> int:
    """The most bytes of PCM16 mono audio a chunk of ``frames`` frames at ``fps`` holds (its sample boundaries round)."""
    return 2 * (math.ceil(frames * SAMPLE_RATE / fps) + 1)


def tone_pcm(first_frame: int, frame_count: int, fps: float, tone_hz: float) -> bytes:
    """PCM16 mono samples of the tone for frames ``[first_frame, first_frame + frame_count)``, made ``TONE_BLOCK``
    samples at a time (a float64 wave of the whole chunk took four times its size at once)."""
    start, stop = _sample_at(first_frame, fps), _sample_at(first_frame + frame_count, fps)
    pcm = np.empty(max(0, stop - start), dtype="<i2")
    for block in range(start, stop, TONE_BLOCK):
        n = np.arange(block, min(stop, block + TONE_BLOCK), dtype=np.float64)
        wave = np.sin(2.0 * np.pi * tone_hz * n / SAMPLE_RATE) * _AMPLITUDE
        pcm[block - start : block - start + len(n)] = np.round(wave)
    return pcm.tobytes()


def _draw_number(frame: np.ndarray, number: int, scale: int) -> None:
    text = f"{number:04d}"
    pad = scale
    glyph_w, glyph_h = 3 * scale, 5 * scale
    box_w = pad + len(text) * (glyph_w + scale)
    box_h = glyph_h + 2 * pad
    h, w = frame.shape[:2]
    frame[: min(box_h, h), : min(box_w, w)] = 0
    for i, digit in enumerate(text):
        mask = np.kron(_GLYPH_MASKS[digit], np.ones((scale, scale), dtype=bool))
        x0 = pad + i * (glyph_w + scale)
        if x0 >= w:
            break
        region = frame[pad : pad + glyph_h, x0 : x0 + glyph_w]
        region[mask[: region.shape[0], : region.shape[1]]] = 255


def render_test_pattern(frame_index: int, width: int, height: int, fps: float) -> np.ndarray:
    """One ``height x width x 3`` uint8 test-pattern frame for the stream's frame ``frame_index``."""
    t = frame_index / fps
    xs = np.linspace(0.0, 255.0, width, dtype=np.float32)
    ys = np.linspace(0.0, 255.0, height, dtype=np.float32)
    frame = np.empty((height, width, 3), dtype=np.uint8)
    frame[..., 0] = xs[None, :].astype(np.uint8)
    frame[..., 1] = ys[:, None].astype(np.uint8)
    frame[..., 2] = (frame_index * 8) % 256
    # a white square bouncing left and right
    side = max(4, height // 6)
    travel = max(1, width - side)
    phase = (frame_index * 4) % (2 * travel)
    x = phase if phase < travel else 2 * travel - phase
    y = height // 2 - side // 2
    frame[y : y + side, x : x + side] = 255
    # a dark disc on a sine path
    radius = max(3, height // 10)
    cx = (width / 2) + (width / 3) * math.cos(2 * math.pi * 0.25 * t)
    cy = (height * 0.7) + (height / 6) * math.sin(2 * math.pi * 0.5 * t)
    yy, xx = np.ogrid[:height, :width]
    frame[(xx - cx) ** 2 + (yy - cy) ** 2 <= radius**2] = (32, 32, 96)
    _draw_number(frame, frame_index, max(1, height // 48))
    return frame


def _resize_nearest(image: np.ndarray, width: int, height: int) -> np.ndarray:
    src_h, src_w = image.shape[:2]
    rows = (np.arange(height) * src_h) // height
    cols = (np.arange(width) * src_w) // width
    return np.ascontiguousarray(image[rows][:, cols])


class _VideoSource:
    """Frames of a video file sampled at ``fps`` (blocking; used from a worker thread)."""

    def __init__(self, path: str, options: ReplayOptions) -> None:
        import av

        self._options = options
        self._container = av.open(path)
        stream = self._container.streams.video[0]
        self._frames: Iterator[Any] = self._container.decode(stream)
        self._rate = float(stream.average_rate or stream.guessed_rate or options.fps)
        self._decoded = 0
        self._current: np.ndarray | None = None
        self._current_time = 0.0
        self._next: tuple[float, np.ndarray] | None = None
        self._ended = False

    def _pull(self) -> tuple[float, np.ndarray] | None:
        if self._ended:
            return None
        try:
            frame = next(self._frames)
        except StopIteration:
            self._ended = True
            return None
        when = float(frame.time) if frame.time is not None else self._decoded / self._rate
        self._decoded += 1
        image = frame.to_ndarray(format="rgb24")
        return when, _resize_nearest(image, self._options.width, self._options.height)

    def frames(self, first_frame: int, count: int) -> list[np.ndarray]:
        """Output frames ``[first_frame, first_frame + count)``; fewer once the video is over."""
        out = []
        for n in range(first_frame, first_frame + count):
            t = n / self._options.fps
            if self._next is None:
                self._next = self._pull()
            # the latest source frame at or before t (the first source frame also covers t before it)
            while self._next is not None and (self._current is None or self._next[0] <= t + 1e-9):
                self._current_time, self._current = self._next
                self._next = self._pull()
            if self._current is None:
                break
            if self._next is None and t >= self._current_time + 1.0 / self._rate - 1e-9:
                break  # past the last source frame's display time: the video is over
            out.append(self._current)
        return out

    def close(self) -> None:
        self._container.close()


def _probe_video(path: str) -> None:
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                has_video = False
            else:
                has_video = True
                decoded = next(iter(container.decode(video=0)), None) is not None
    except Exception as exc:  # av raises its own error types (some of them ValueErrors)
        raise ValueError(f"replay option 'video_path': cannot decode {path!r}: {exc}") from exc
    if not has_video:
        raise ValueError(f"replay option 'video_path': {path!r} has no video stream")
    if not decoded:
        raise ValueError(f"replay option 'video_path': {path!r} has no decodable frames")


class _ReplayStream:
    """The chunk iterator of one stream; closing or exhausting it frees the service's one session."""

    def __init__(self, service: ReplayService, options: ReplayOptions) -> None:
        self._service = service
        self._generator = service._generate(options)

    def __aiter__(self) -> _ReplayStream:
        return self

    async def __anext__(self) -> Chunk:
        try:
            return await self._generator.__anext__()
        except BaseException:
            self._service._release(self)
            raise

    async def aclose(self) -> None:
        try:
            await self._generator.aclose()
        finally:
            self._service._release(self)


class ReplayService(ServerPushService):
    """Streams a test pattern or a video file, with a sine tone; one stream (session) at a time."""

    # nothing it streams depends on a prompt or a reference image: a request giving either is refused, not ignored
    takes_prompt = False
    takes_image = False

    def __init__(self, gpu_num: int = 0, *, videos: str | None = ANY_FILE) -> None:
        self.gpu_num = gpu_num
        self.videos = videos
        self._running = False
        self._active: _ReplayStream | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ReplayService]:
        if self._running:
            raise RuntimeError("replay service is already running")
        self._running = True
        try:
            yield self
        finally:
            self._running = False
            self._active = None

    def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        """Validate the request now (``ValueError`` naming the option) and return its chunk stream.

        Raises ``RuntimeError`` outside ``running()`` or while another stream is open (close it with
        ``aclose()`` or run it to the end first).
        """
        if not self._running:
            raise RuntimeError("replay service: stream() called outside `async with service.running()`")
        options = self._options(config.options)
        if self._active is not None:
            raise RuntimeError("replay service serves one stream at a time (server-push: one retained session)")
        self._active = _ReplayStream(self, options)
        return self._active

    async def check_options(self, options: Mapping[str, Any]) -> None:
        """The check :meth:`stream` runs (``ValueError`` naming the option); a named video is probed."""
        self._options(options)

    def _options(self, options: Mapping[str, Any]) -> ReplayOptions:
        checked = ReplayOptions.from_mapping(options, self.videos)
        if checked.video_path is not None:
            _probe_video(checked.video_path)
        return checked

    def _release(self, stream: _ReplayStream) -> None:
        if self._active is stream:
            self._active = None

    async def _generate(self, options: ReplayOptions) -> AsyncIterator[Chunk]:
        source = None
        try:
            if options.video_path is not None:
                source = await trio.to_thread.run_sync(_VideoSource, options.video_path, options)
            total_frames = options.chunk_count * options.frames_per_chunk
            first = 0
            for index in range(options.chunk_count):
                count = min(options.frames_per_chunk, total_frames - first)
                if source is not None:
                    images = await trio.to_thread.run_sync(source.frames, first, count)
                else:
                    images = await trio.to_thread.run_sync(self._pattern, options, first, count)
                if not images:
                    return
                count = len(images)
                audio = Audio(pcm=tone_pcm(first, count, options.fps, options.tone_hz), sample_rate=SAMPLE_RATE)
                yield Chunk(
                    index=index,
                    frames=np.stack(images),
                    fps=options.fps,
                    audio=audio,
                    metadata={
                        "source": "video" if source is not None else "test_pattern",
                        "first_frame": first,
                    },
                )
                first += count
                if count < options.frames_per_chunk:
                    return
        finally:
            if source is not None:
                source.close()

    @staticmethod
    def _pattern(options: ReplayOptions, first: int, count: int) -> list[np.ndarray]:
        return [render_test_pattern(n, options.width, options.height, options.fps) for n in range(first, first + count)]

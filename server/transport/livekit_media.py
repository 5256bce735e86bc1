"""The worker's media in a LiveKit room: one VP8 video track and one PCM audio track (reference B.11).

The first frame creates ``rtc.VideoSource(width, height)`` and a local video track ``"chunkline-output"``,
published as camera, VP8, simulcast off, ``max_framerate = fps`` (of the first frame; later fps changes do
not republish), ``max_bitrate = 8_000_000``, keeping resolution under load; the first frame then waits (at
most ``FIRST_SUBSCRIBER_WAIT``) for a subscriber. Frames are RGB24 ``VideoFrame`` objects sharing the
array's memory (the SDK converts RGB24 to I420 itself, so nothing is copied on the trio thread); a frame
of a different size raises. While no new frame comes, the last one is captured again every
``IDLE_REPEAT_PERIOD`` so a subscriber that became ready late (or a viewer joining a still scene) sees
the picture. The first audio creates ``rtc.AudioSource(rate, channels)`` with a queue of
``AUDIO_QUEUE_MS`` (a chunk's audio longer than the SDK's 1 s default must not stall the next chunk's
video) and a microphone track ``"chunkline-audio"``; a format change raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import numpy as np
from livekit import rtc

from pipelines.contract import Audio

from .base import TransportError

__all__ = [
    "AUDIO_QUEUE_MS", "AUDIO_TRACK_NAME", "FIRST_SUBSCRIBER_WAIT", "IDLE_REPEAT_PERIOD", "MAX_VIDEO_BITRATE",
    "VIDEO_TRACK_NAME", "MediaPublisher", "audio_options", "check_frame", "close_quietly", "rgb_frame",
    "video_options",
]

log = logging.getLogger(__name__)

VIDEO_TRACK_NAME = "chunkline-output"
AUDIO_TRACK_NAME = "chunkline-audio"
MAX_VIDEO_BITRATE = 8_000_000
IDLE_REPEAT_PERIOD = 0.25  # s: while idle, the last frame is captured again this often
FIRST_SUBSCRIBER_WAIT = 3.0  # s the first video frame waits for a subscriber to the new track
AUDIO_QUEUE_MS = 4000  # the audio source's queue: a few chunks of audio


async def close_quietly(source: rtc.VideoSource | rtc.AudioSource) -> None:
    try:
        await source.aclose()
    except Exception as exc:  # noqa: BLE001 - best-effort cleanup
        log.debug("closing %s failed: %s", type(source).__name__, exc)


def video_options(fps: float) -> rtc.TrackPublishOptions:
    return rtc.TrackPublishOptions(
        source=rtc.TrackSource.SOURCE_CAMERA,
        simulcast=False,
        video_codec=rtc.VideoCodec.VP8,
        video_encoding=rtc.VideoEncoding(max_framerate=float(fps), max_bitrate=MAX_VIDEO_BITRATE),
        # under CPU load the encoder lowers the frame rate, not the picture size the viewers see
        degradation_preference=rtc.DegradationPreference.MAINTAIN_RESOLUTION,
    )


def audio_options() -> rtc.TrackPublishOptions:
    return rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)


def check_frame(frame: np.ndarray, fps: float) -> tuple[int, int]:
    if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise TransportError(
            f"a frame must be an H x W x 3 uint8 array, got {getattr(frame, 'shape', type(frame).__name__)} "
            f"{getattr(frame, 'dtype', '')}".rstrip()
        )
    height, width = int(frame.shape[0]), int(frame.shape[1])
    if height <= 0 or width <= 0:
        raise TransportError(f"a frame must not be empty, got {height}x{width}")
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps) or fps <= 0:
        raise TransportError(f"fps must be a finite number > 0, got {fps!r}")
    return width, height


def rgb_frame(frame: np.ndarray) -> rtc.VideoFrame:
    """An RGB ``H x W x 3`` uint8 array as an SDK RGB24 frame, sharing the array's memory (no copy when it
    is contiguous). The SDK reads it during ``capture_frame`` (converting it to I420), so the array must
    live until that call returns."""
    height, width = int(frame.shape[0]), int(frame.shape[1])
    flat = np.ascontiguousarray(frame).reshape(-1)  # 1-D, so the SDK sees the whole buffer and copies nothing
    return rtc.VideoFrame(width, height, rtc.VideoBufferType.RGB24, memoryview(flat))


class MediaPublisher:
    """The video and audio sources and local tracks of one connection.

    ``participant`` is the room's local participant, or ``None`` for a
    standalone publisher (tracks are created but not published; used by tests).
    The ``async`` methods are asyncio coroutines: run them on the trio-asyncio
    loop (``aio_as_trio(..., loop=loop)``). :meth:`capture_video` is a plain
    synchronous FFI call and may be called from trio directly.
    """

    def __init__(self, participant: rtc.LocalParticipant | None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._participant = participant
        self._loop = loop  # set: repeat the last frame while the stream is idle (see _repeat_last_frame)
        self._last_frame: rtc.VideoFrame | None = None
        self._last_capture = 0.0
        self._repeat: asyncio.TimerHandle | None = None
        self.frames_repeated = 0
        self.video_source: rtc.VideoSource | None = None
        self.video_track: rtc.LocalVideoTrack | None = None
        self.video_size: tuple[int, int] | None = None  # (width, height)
        self.audio_source: rtc.AudioSource | None = None
        self.audio_track: rtc.LocalAudioTrack | None = None
        self.audio_format: tuple[int, int] | None = None  # (sample_rate, channels)
        self._published: list[str] = []  # track sids to unpublish
        self.frames_captured = 0
        self.audio_frames_captured = 0
        self.closed = False

    @property
    def video_ready(self) -> bool:
        return self.video_source is not None

    async def start_video(self, width: int, height: int, fps: float) -> None:
        """Create (and publish, when in a room) the video source and track; asyncio side."""
        if self.video_source is not None:
            return
        source = rtc.VideoSource(width, height)
        track = rtc.LocalVideoTrack.create_video_track(VIDEO_TRACK_NAME, source)
        if self._participant is not None:
            try:  # kept only once published: a failed publish is raised again by the next frame
                publication = await self._participant.publish_track(track, video_options(fps))
            except BaseException:
                await close_quietly(source)
                raise
            self._published.append(publication.sid)
            # Frames captured before anyone subscribed are encoded and dropped by the server: a chunk's
            # few frames would never be seen. The first subscriber (the controller is in the room by
            # now) takes a round trip; wait for it, for a bounded time.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(publication.wait_for_subscription(), FIRST_SUBSCRIBER_WAIT)
        self.video_source, self.video_track, self.video_size = source, track, (width, height)

    def capture_video(self, frame: np.ndarray) -> None:
        """Hand one RGB ``H x W x 3`` uint8 frame to the video source (synchronous FFI call)."""
        if self.closed:
            raise TransportError("the media publisher is closed")
        if self.video_source is None or self.video_size is None:
            raise TransportError("the video source is not started")
        height, width = int(frame.shape[0]), int(frame.shape[1])
        if (width, height) != self.video_size:
            expected_w, expected_h = self.video_size
            raise TransportError(
                f"frame size changed from {expected_w}x{expected_h} to {width}x{height}; "
                "a LiveKit video track keeps one size"
            )
        video = rgb_frame(frame)
        self.video_source.capture_frame(video)
        self.frames_captured += 1
        self._last_frame = video
        if self._loop is not None:
            self._last_capture = self._loop.time()
            if self._repeat is None:
                self._repeat = self._loop.call_later(IDLE_REPEAT_PERIOD, self._repeat_last_frame)

    def _repeat_last_frame(self) -> None:
        """Asyncio timer: while no new frame comes (no key held: no chunks), capture the last one again.

        The server forwards only what is encoded after a subscriber is ready, so the few frames of the
        first chunk, or the still picture a viewer joins into, would otherwise never be seen; a repeated
        still frame costs the encoder next to nothing.
        """
        self._repeat = None
        if self.closed or self.video_source is None or self._last_frame is None or self._loop is None:
            return
        idle = self._loop.time() - self._last_capture
        if idle >= IDLE_REPEAT_PERIOD:
            try:
                self.video_source.capture_frame(self._last_frame)
            except Exception as exc:  # noqa: BLE001 - the source is going away; the next real frame will tell
                log.debug("repeating the last frame failed: %s", exc)
                return
            self.frames_repeated += 1
            idle = 0.0
        self._repeat = self._loop.call_later(IDLE_REPEAT_PERIOD - idle, self._repeat_last_frame)

    async def publish_frame(self, frame: np.ndarray, fps: float) -> None:
        """Asyncio side: start the video track on the first frame, then capture ``frame``."""
        width, height = check_frame(frame, fps)
        if self.video_source is None:
            await self.start_video(width, height, fps)
        self.capture_video(frame)

    async def publish_audio(self, audio: Audio) -> None:
        """Asyncio side: start the audio track on first use, then capture the PCM16 samples."""
        if self.closed:
            raise TransportError("the media publisher is closed")
        fmt = (audio.sample_rate, audio.channels)
        if self.audio_source is None:
            # AudioSource captures the running loop: this must run on the trio-asyncio loop.
            # The queue holds several chunks of audio: capturing one chunk's audio (which may be longer than
            # the SDK's default 1 s queue) must not wait for it to play out, or the next chunk's video stalls.
            source = rtc.AudioSource(audio.sample_rate, audio.channels, queue_size_ms=AUDIO_QUEUE_MS)
            track = rtc.LocalAudioTrack.create_audio_track(AUDIO_TRACK_NAME, source)
            if self._participant is not None:
                try:
                    publication = await self._participant.publish_track(track, audio_options())
                except BaseException:
                    await close_quietly(source)
                    raise
                self._published.append(publication.sid)
            self.audio_source, self.audio_track, self.audio_format = source, track, fmt
        elif fmt != self.audio_format:
            raise TransportError(
                f"audio format changed from {self.audio_format[0]} Hz x {self.audio_format[1]} "  # type: ignore[index]
                f"to {audio.sample_rate} Hz x {audio.channels}; a LiveKit audio track keeps one format"
            )
        samples = audio.samples_per_channel
        if samples == 0:
            return
        # longer audio than the queue would wait for playout: hand it over in queue-sized pieces, so only
        # audio beyond AUDIO_QUEUE_MS of backlog ever waits
        step = max(1, audio.sample_rate * AUDIO_QUEUE_MS // 2000)
        width = 2 * audio.channels  # PCM16
        for start in range(0, samples, step):
            count = min(step, samples - start)
            piece = audio.pcm[start * width : (start + count) * width]
            await self.audio_source.capture_frame(rtc.AudioFrame(piece, audio.sample_rate, audio.channels, count))
        self.audio_frames_captured += 1

    async def aclose(self) -> None:
        """Asyncio side: close the sources (leaving the room unpublishes the tracks). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._published = []
        if self._repeat is not None:
            self._repeat.cancel()
            self._repeat = None
        for source in (self.video_source, self.audio_source):
            if source is not None:
                await close_quietly(source)

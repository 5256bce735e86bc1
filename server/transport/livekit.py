"""LiveKit rooms through trio-asyncio: the production implementation of the transport port.

The LiveKit Python SDK (``livekit.rtc``) is asyncio code over a Rust core. The
server is trio, so the transport keeps one trio-asyncio loop open for its whole
life and runs every SDK coroutine on it with ``aio_as_trio(..., loop=loop)``.
The loop is passed explicitly, so ``connect`` and the connection methods work
from any trio task (quart-trio request handlers and room runners are not
children of the task that opened the loop).

Starting it (required; ``connect`` raises :class:`TransportError` otherwise)::

    transport = LiveKitTransport(url)
    await nursery.start(transport.run)   # opens the loop; runs until cancelled

When ``run`` is cancelled it first disconnects the connections still open
(bounded by ``disconnect_timeout``), then closes the loop.

SDK objects that capture an event loop (``rtc.Room``, ``rtc.AudioSource``) are
only ever built inside coroutines running on that loop. Room callbacks
(``data_received``, ``participant_connected``, ``participant_disconnected``,
``disconnected``) run as asyncio callbacks of the same loop, i.e. on the trio
thread inside the loop's trio task, so they hand events to the runner with
``send_nowait`` on a trio memory channel.

Media (reference B.11): the first frame creates ``rtc.VideoSource(width,
height)`` and a local video track ``"chunkline-output"``, published as camera,
VP8, simulcast off, ``max_framerate = fps`` (of the first frame; later fps
changes do not republish), ``max_bitrate = 8_000_000``. Frames are RGB24
``VideoFrame`` objects (the SDK converts RGB24 to I420 itself); a frame of a
different size raises. The first audio creates ``rtc.AudioSource(rate,
channels)`` and a microphone track ``"chunkline-audio"``; a format change
raises. Data goes through ``local_participant.publish_data(payload,
reliable=..., topic=...)``.

Timeouts: ``connect`` is bounded by its ``timeout`` with ``trio.fail_after``
(an unreachable port fails in about 0.1 s, but a server that accepts and never
answers would otherwise take 4 x (attempt timeout + about 3 s) inside the
SDK). ``connect_timeout`` is the SDK's per-attempt signal timeout
(``RoomOptions.connect_timeout``, capped at the overall ``timeout``). After a
timeout the asyncio task is cancelled, but the Rust core may keep trying in the
background; should it then succeed, the orphaned participant is evicted by the
next join with the same identity (LiveKit allows one participant per identity).

Logging: livekit logs each connection retry at WARNING (and the final failure
at ERROR) on the ``livekit`` logger. This module does not change logging
configuration; an application that wants quiet logs sets
``logging.getLogger("livekit").setLevel(logging.ERROR)`` itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import trio
import trio_asyncio
from livekit import rtc

from pipelines.contract import Audio

from .base import (
    DataReceived,
    ParticipantJoined,
    ParticipantLeft,
    RoomEvent,
    TransportError,
)

__all__ = ["AUDIO_TRACK_NAME", "MAX_VIDEO_BITRATE", "VIDEO_TRACK_NAME", "LiveKitTransport"]

log = logging.getLogger(__name__)

VIDEO_TRACK_NAME = "chunkline-output"
AUDIO_TRACK_NAME = "chunkline-audio"
MAX_VIDEO_BITRATE = 8_000_000
EVENT_BACKLOG = 256  # data/participant events kept for the runner (data beyond it is dropped)


def _video_options(fps: float) -> rtc.TrackPublishOptions:
    return rtc.TrackPublishOptions(
        source=rtc.TrackSource.SOURCE_CAMERA,
        simulcast=False,
        video_codec=rtc.VideoCodec.VP8,
        video_encoding=rtc.VideoEncoding(max_framerate=float(fps), max_bitrate=MAX_VIDEO_BITRATE),
    )


def _audio_options() -> rtc.TrackPublishOptions:
    return rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE)


def _check_frame(frame: np.ndarray, fps: float) -> tuple[int, int]:
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


def _rgb_frame(frame: np.ndarray) -> rtc.VideoFrame:
    """An RGB ``H x W x 3`` uint8 array as an SDK RGB24 frame (copied; the SDK converts it to I420)."""
    height, width = int(frame.shape[0]), int(frame.shape[1])
    return rtc.VideoFrame(width, height, rtc.VideoBufferType.RGB24, np.ascontiguousarray(frame).tobytes())


class _MediaPublisher:
    """The video and audio sources and local tracks of one connection.

    ``participant`` is the room's local participant, or ``None`` for a
    standalone publisher (tracks are created but not published; used by tests).
    The ``async`` methods are asyncio coroutines: run them on the trio-asyncio
    loop (``aio_as_trio(..., loop=loop)``). :meth:`capture_video` is a plain
    synchronous FFI call and may be called from trio directly.
    """

    def __init__(self, participant: rtc.LocalParticipant | None) -> None:
        self._participant = participant
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
        self.video_source, self.video_track, self.video_size = source, track, (width, height)
        if self._participant is not None:
            publication = await self._participant.publish_track(track, _video_options(fps))
            self._published.append(publication.sid)

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
        self.video_source.capture_frame(_rgb_frame(frame))
        self.frames_captured += 1

    async def publish_frame(self, frame: np.ndarray, fps: float) -> None:
        """Asyncio side: start the video track on the first frame, then capture ``frame``."""
        width, height = _check_frame(frame, fps)
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
            source = rtc.AudioSource(audio.sample_rate, audio.channels)
            track = rtc.LocalAudioTrack.create_audio_track(AUDIO_TRACK_NAME, source)
            self.audio_source, self.audio_track, self.audio_format = source, track, fmt
            if self._participant is not None:
                publication = await self._participant.publish_track(track, _audio_options())
                self._published.append(publication.sid)
        elif fmt != self.audio_format:
            raise TransportError(
                f"audio format changed from {self.audio_format[0]} Hz x {self.audio_format[1]} "  # type: ignore[index]
                f"to {audio.sample_rate} Hz x {audio.channels}; a LiveKit audio track keeps one format"
            )
        samples = audio.samples_per_channel
        if samples == 0:
            return
        frame = rtc.AudioFrame(audio.pcm, audio.sample_rate, audio.channels, samples)
        await self.audio_source.capture_frame(frame)
        self.audio_frames_captured += 1

    async def aclose(self) -> None:
        """Asyncio side: unpublish the tracks (when in a connected room) and close the sources. Idempotent."""
        if self.closed:
            return
        self.closed = True
        participant, published = self._participant, self._published
        self._published = []
        for sid in published:
            try:
                await participant.unpublish_track(sid)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - best effort: the room may be gone already
                log.debug("unpublishing track %s failed: %s", sid, exc)
        for source in (self.video_source, self.audio_source):
            if source is not None:
                try:
                    await source.aclose()
                except Exception as exc:  # noqa: BLE001 - best-effort cleanup
                    log.debug("closing %s failed: %s", type(source).__name__, exc)


class _LiveKitConnection:
    """The worker's presence in one LiveKit room (implements the RoomConnection port)."""

    def __init__(self, transport: LiveKitTransport, loop: Any, room_name: str, identity: str) -> None:
        self._transport = transport
        self._loop = loop
        self.room_name = room_name
        self._identity = identity
        self._send, self._receive = trio.open_memory_channel[RoomEvent](EVENT_BACKLOG)
        self.room: rtc.Room | None = None
        self.media: _MediaPublisher | None = None
        self._closed = False  # disconnect() was called
        self._lost: str | None = None  # why the room went away on its own
        self.dropped_events = 0

    @property
    def identity(self) -> str:
        return self._identity

    # -- asyncio side ----------------------------------------------------------------

    def _attach(self, room: rtc.Room) -> None:
        """Register the room callbacks (asyncio side, before connecting so nothing is missed)."""
        self.room = room
        room.on("data_received", self._on_data)
        room.on("participant_connected", self._on_joined)
        room.on("participant_disconnected", self._on_left)
        room.on("disconnected", self._on_disconnected)

    def _deliver(self, event: RoomEvent) -> None:
        if self._closed or self._lost is not None:
            return
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self.dropped_events += 1  # a flood of data messages: the runner reads what it can
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def _on_data(self, packet: rtc.DataPacket) -> None:
        sender = packet.participant.identity if packet.participant is not None else None
        self._deliver(DataReceived(packet.topic or "", bytes(packet.data), sender))

    def _on_joined(self, participant: rtc.RemoteParticipant) -> None:
        self._deliver(ParticipantJoined(participant.identity))

    def _on_left(self, participant: rtc.RemoteParticipant) -> None:
        self._deliver(ParticipantLeft(participant.identity))

    def _on_disconnected(self, reason: Any = None) -> None:
        if self._closed:
            return
        try:
            label = rtc.DisconnectReason.Name(reason) if isinstance(reason, int) else str(reason)
        except ValueError:
            label = str(reason)
        self._lost = f"LiveKit room {self.room_name!r} disconnected ({label})"
        self._send.close()  # events() ends

    async def _aio_connect(self, url: str, token: str, attempt_timeout: float) -> None:
        room = rtc.Room(loop=self._loop)
        self._attach(room)
        await room.connect(url, token, rtc.RoomOptions(connect_timeout=attempt_timeout))
        self.media = _MediaPublisher(room.local_participant)

    async def _aio_close(self) -> None:
        if self.media is not None:
            await self.media.aclose()
        if self.room is not None:
            await self.room.disconnect()

    # -- trio side (the port) ------------------------------------------------------------

    def _check_usable(self) -> _MediaPublisher:
        if self._closed:
            raise TransportError("the worker left the room")
        if self._lost is not None:
            raise TransportError(self._lost)
        if self.media is None or self._transport._loop is not self._loop:
            raise TransportError("the LiveKit transport is not running")
        return self.media

    async def _on_aio(self, fn: Any, *args: Any) -> Any:
        return await trio_asyncio.aio_as_trio(fn, loop=self._loop)(*args)

    def participants(self) -> frozenset[str]:
        if self.room is None or self._closed:
            return frozenset()
        return frozenset(p.identity for p in self.room.remote_participants.values())

    async def events(self) -> AsyncIterator[RoomEvent]:
        async for event in self._receive:
            yield event

    async def publish_frame(self, frame: np.ndarray, fps: float) -> None:
        media = self._check_usable()
        _check_frame(frame, fps)
        if not media.video_ready:
            await self._wrap("publishing the video track", media.start_video, frame.shape[1], frame.shape[0], fps)
        media.capture_video(frame)  # a synchronous FFI call: no need to hop to asyncio

    async def publish_audio(self, audio: Audio) -> None:
        media = self._check_usable()
        await self._wrap("publishing audio", media.publish_audio, audio)

    async def send_data(self, topic: str, payload: bytes, *, reliable: bool = True) -> None:
        self._check_usable()
        participant = self.room.local_participant  # type: ignore[union-attr]

        async def publish() -> None:
            await participant.publish_data(bytes(payload), reliable=reliable, topic=topic)

        await self._wrap(f"sending data on {topic!r}", publish)

    async def _wrap(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return await self._on_aio(fn, *args)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"LiveKit: {what} failed: {exc}") from exc

    async def disconnect(self) -> None:
        """Unpublish, close the sources and leave the room; shielded and bounded by ``disconnect_timeout``."""
        if self._closed:
            return
        self._closed = True
        self._send.close()
        self._transport._connections.discard(self)
        if self._transport._loop is not self._loop:
            return  # the loop is gone, and the room with it
        with trio.CancelScope(shield=True), trio.move_on_after(self._transport.disconnect_timeout) as scope:
            try:
                await self._on_aio(self._aio_close)
            except Exception as exc:  # noqa: BLE001 - leaving is best effort
                log.warning("leaving LiveKit room %r: %s", self.room_name, exc)
        if scope.cancelled_caught:
            log.warning(
                "leaving LiveKit room %r took longer than %g s; gave up waiting",
                self.room_name,
                self._transport.disconnect_timeout,
            )


class LiveKitTransport:
    """Joins LiveKit rooms as the worker participant. Start :meth:`run` in a nursery first."""

    name = "livekit"

    def __init__(self, url: str, *, connect_timeout: float = 10.0, disconnect_timeout: float = 5.0) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError("the LiveKit url must be a non-empty string (ws://, wss://, http:// or https://)")
        for label, value in (("connect_timeout", connect_timeout), ("disconnect_timeout", disconnect_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{label} must be a finite number > 0, got {value!r}")
        self.url = url
        self.connect_timeout = float(connect_timeout)
        self.disconnect_timeout = float(disconnect_timeout)
        self._loop: Any = None
        self._connections: set[_LiveKitConnection] = set()

    @property
    def running(self) -> bool:
        return self._loop is not None

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the trio-asyncio loop until cancelled: ``await nursery.start(transport.run)``."""
        if self._loop is not None:
            raise RuntimeError("LiveKitTransport.run is already running")
        async with trio_asyncio.open_loop() as loop:
            self._loop = loop
            try:
                task_status.started(loop)
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    for connection in list(self._connections):
                        await connection.disconnect()
                self._loop = None

    async def connect(self, room: str, identity: str, token: str, *, timeout: float) -> _LiveKitConnection:
        """Join ``room`` as ``identity`` with a worker token, or raise TransportError within ``timeout``."""
        loop = self._loop
        if loop is None:
            raise TransportError(
                "the LiveKit transport is not running: start it first with `await nursery.start(transport.run)`"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
            raise TransportError(f"connect timeout must be a finite number > 0, got {timeout!r}")
        connection = _LiveKitConnection(self, loop, room, identity)
        prefix = f"could not connect to LiveKit at {self.url} within {timeout:g} s"
        try:
            with trio.fail_after(timeout):
                await trio_asyncio.aio_as_trio(connection._aio_connect, loop=loop)(
                    self.url, token, min(self.connect_timeout, float(timeout))
                )
        except trio.TooSlowError:
            await self._abandon(connection)
            raise TransportError(f"{prefix}: no answer (timed out)") from None
        except rtc.ConnectError as exc:
            raise TransportError(f"{prefix}: {exc.message}") from exc
        except Exception as exc:  # a malformed url or token, or the SDK failing otherwise
            await self._abandon(connection)
            raise TransportError(f"{prefix}: {type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancelled by the caller
            await self._abandon(connection)
            raise
        self._connections.add(connection)
        return connection

    async def _abandon(self, connection: _LiveKitConnection) -> None:
        """Leave a room whose connect finished just as it was cancelled (else: nothing to do)."""
        if connection.room is not None and connection.room.isconnected():
            await connection.disconnect()
        else:
            connection._closed = True
            connection._send.close()

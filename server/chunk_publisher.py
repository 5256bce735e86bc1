"""One session's media into its room, and the figures told about it.

The room runner (:mod:`server.runner`) owns the session's lifecycle, its room and its controls; what it
publishes goes through a :class:`ChunkPublisher`: each chunk's frames paced at the chunk's fps (no catch-up
burst after a stall), then its audio, then the ``tf.status`` chunk message; ``tf.metrics`` every second
(chunk period, published fps, real-time factor, control-to-output latency); and the counts the runner's
``done`` message reports.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import trio

from pipelines.contract import PipelineContractError

from . import protocol
from .transport import TransportError

if TYPE_CHECKING:
    from pipelines.contract import Chunk

    from .metrics import ServerMetrics
    from .transport import RoomConnection

__all__ = ["METRICS_PERIOD", "ChunkPublisher", "checked_metadata"]

METRICS_PERIOD = 1.0  # seconds between two ``tf.metrics`` messages


def checked_metadata(chunk: Chunk) -> Chunk:
    """``chunk``, if its metadata and applied controls go into its ``tf.status`` message; else the pipeline's bug,
    naming the key, raised where the chunk is received (in-process, from a worker process or on an agent alike)
    rather than once its frames are out and its message is built."""
    for field, values in (("metadata", chunk.metadata), ("applied_controls", chunk.applied_controls)):
        try:
            protocol.chunk_message("check", chunk.index, values, timestamp=0.0)
        except Exception as exc:
            key, cause = next(((k, e) for k, e in _key_errors(chunk.index, values)), ("", exc))
            raise PipelineContractError(
                f"chunk {chunk.index}'s {field} key {key!r} cannot be sent as JSON in its tf.status message: "
                f"{type(cause).__name__}: {cause}"
            ) from None
    stage_times = chunk.metadata.get("stage_times")
    if stage_times is not None and not isinstance(stage_times, Mapping):
        raise PipelineContractError(
            f"chunk {chunk.index}'s metadata key 'stage_times' is a {type(stage_times).__name__}, not a mapping of "
            f"stage name to seconds"
        )
    return chunk


def _key_errors(index: int, values: Mapping[str, Any]) -> Iterator[tuple[str, Exception]]:
    """The keys of ``values`` whose value alone cannot be encoded, with the error."""
    for key, value in values.items():
        try:
            protocol.chunk_message("check", index, {key: value}, timestamp=0.0)
        except Exception as exc:
            yield key, exc


class _Pacer:
    """Deadline-based pacing at the chunk's fps, with no catch-up burst after a stall."""

    def __init__(self) -> None:
        self.next_at: float | None = None

    async def wait(self, fps: float) -> None:
        interval = 1.0 / fps
        now = trio.current_time()
        if self.next_at is None or now - self.next_at > interval:
            self.next_at = now
        await trio.sleep_until(self.next_at)
        self.next_at += interval


class ChunkPublisher:
    """Publishes one session's chunks on its room connection and keeps the figures about them."""

    def __init__(self, connection: RoomConnection, metrics: ServerMetrics, session_id: str, stopping: trio.Event) -> None:
        self._connection = connection
        self._metrics = metrics
        self._session_id = session_id
        self._stopping = stopping  # set when the session drains: no more frames go out
        self._pacer = _Pacer()
        self.published_chunks = 0
        self.published_frames = 0
        self._chunk_times: deque[float] = deque(maxlen=32)
        self._last_latency: float | None = None
        self._rtf: float | None = None
        self._frames_per_chunk = 0

    async def publish(self, chunk: Chunk) -> bytes | None:
        """Publish ``chunk``'s frames and audio; returns its ``tf.status`` message, or None if the session began
        draining before the chunk was out (a chunk cut short is not reported)."""
        started = time.time()
        compute = sum(v for v in chunk.metadata.get("stage_times", {}).values() if isinstance(v, int | float))
        self._metrics.record_chunk_processed(compute or None)  # made, whether or not it says how long it took
        sent = 0
        try:
            for frame in chunk.frames:
                if self._stopping.is_set():
                    return None
                await self._pacer.wait(chunk.fps)
                await self._connection.publish_frame(frame, chunk.fps)
                self.published_frames += 1
                sent += 1
        finally:
            if sent < chunk.frame_count:  # cut short (a stop, a drain, a cancel): what went out counts, as in `done`
                self._metrics.record_frames_published(self._session_id, sent)
        if chunk.audio is not None and not self._stopping.is_set():
            await self._connection.publish_audio(chunk.audio)
        self.published_chunks += 1
        self._frames_per_chunk = chunk.frame_count
        self._chunk_times.append(trio.current_time())
        self._metrics.record_chunk_published(self._session_id, chunk.frame_count)
        latency = chunk.metadata.get("control_to_output_seconds")
        if isinstance(latency, int | float) and math.isfinite(latency):
            self._last_latency = float(latency)
        if compute:
            self._rtf = compute / chunk.media_seconds
        # the pipeline's own metadata keys win: the publisher's figures only fill in what it did not say
        data = {
            "frames": chunk.frame_count,
            "fps": chunk.fps,
            "applied_controls": dict(chunk.applied_controls),
            "publish_started_at": started,
            "publish_finished_at": time.time(),
            **chunk.metadata,
        }
        return protocol.chunk_message(self._session_id, chunk.index, data)

    async def report_metrics(self) -> None:
        """Lossy ``tf.metrics`` every :data:`METRICS_PERIOD` until the room connection is gone."""
        while True:
            await trio.sleep(METRICS_PERIOD)
            times = list(self._chunk_times)
            period = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            payload = protocol.metrics_message(
                self._session_id,
                chunk_period_seconds=period,
                published_fps=None if period is None else self._frames_per_chunk / period,
                real_time_factor=self._rtf,
                control_to_output_seconds=self._last_latency,
                published_frames=self.published_frames,
            )
            try:
                await self._connection.send_data(protocol.METRICS_TOPIC, payload, reliable=False)
            except TransportError:
                return

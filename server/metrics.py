"""Serving metrics: one Prometheus registry per app, plus a JSON summary of the same numbers.

`ServerMetrics` is the server's only metrics object. It owns a private
`prometheus_client.CollectorRegistry` (never the process-global one), so two apps in one
process — two tests, say — never share a sample. Every name starts with `chunkline_`.

Labels are low-cardinality enums only (`result`, `reason`, `status`, `state`, `scope`).
Session and room ids never become label values: the `session_key` passed to
`record_control`, `record_chunk_published` and `record_session_finished` keys internal
per-session state (the pending action, the per-session fps window) and nothing else.

Published fps
-------------
`chunkline_published_fps{scope}` is computed when the registry is collected, over the
trailing window of `fps_window_seconds` (the scopes and how they are computed:
`server.published_fps`).

Action to first frame
---------------------
`record_control(key)` stamps a pending action for the session; the first
`record_chunk_published(key, frames > 0, at)` with `at >= stamp` observes `at - stamp` in
`chunkline_action_to_first_frame_seconds` and clears it. Only one action per session is
pending: a newer control overwrites the older one and counts in
`chunkline_actions_overwritten_total`. Every accepted control counts as an action.

The object is not thread-safe beyond what prometheus_client itself guarantees: record from
the server's trio thread, and collect (`prometheus_text`, `summary`) from that thread too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .histogram_summary import histogram_summary
from .published_fps import FPS_SCOPES, PublishedFps

__all__ = [
    "ADMISSION_RESULTS",
    "CHUNK_RESULTS",
    "CONTENT_TYPE",
    "FINISH_RESULTS",
    "FPS_SCOPES",
    "LATENCY_BUCKETS",
    "ServerMetrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
)
ADMISSION_RESULTS = ("assigned", "queued", "rejected")
CHUNK_RESULTS = ("processed", "published")
FINISH_RESULTS = ("closed", "failed", "expired")
LOSS_CAUSES = ("authority_stalled", "connection_closed", "heartbeat_missed", "process_exited", "agent_failed",
               "actor_died", "actor_unreachable", "protocol_error")


def _count_reason(counter: Counter, what: str, reason: str, count: int) -> None:
    """``counter``'s ``reason`` label up by ``count``, both checked (``what`` names them in the error)."""
    if not isinstance(reason, str) or not reason:
        raise ValueError(f"{what} reason must be a non-empty string, got {reason!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{what} count must be an int >= 1, got {count!r}")
    counter.labels(reason=reason).inc(count)


class _PublishedFpsCollector(Collector):
    """Computes `chunkline_published_fps{scope}` and `chunkline_uptime_seconds` per scrape."""

    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "chunkline_published_fps",
            "Published frames per second over the trailing window",
            labels=["scope"],
        )
        yield GaugeMetricFamily(
            "chunkline_uptime_seconds", "Seconds since the metrics were created"
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fps = GaugeMetricFamily(
            "chunkline_published_fps",
            "Published frames per second over the trailing window",
            labels=["scope"],
        )
        for scope, value in self._owner.published_fps().items():
            fps.add_metric([scope], value)
        yield fps
        yield GaugeMetricFamily(
            "chunkline_uptime_seconds",
            "Seconds since the metrics were created",
            value=self._owner.uptime_seconds(),
        )


class ServerMetrics:
    """The stream server's metrics, on a registry of its own (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        fps_window_seconds: float = 30.0,
    ) -> None:
        self._fps = PublishedFps(fps_window_seconds)
        self._clock = clock
        self._started_at = clock()
        self._pending_actions: dict[str, float] = {}
        self._session_statuses: set[str] = set()
        self._worker_states: set[str] = set()

        self.registry = CollectorRegistry()
        registry = self.registry

        self._admissions = Counter(
            "chunkline_admissions",
            "Session admission decisions by result",
            ["result"],
            registry=registry,
        )
        self._control_rejections = Counter(
            "chunkline_control_rejections",
            "Control messages rejected, by reason",
            ["reason"],
            registry=registry,
        )
        self._room_refusals = Counter(
            "chunkline_room_refusals",
            "Client messages the local rooms did not pass on, and sockets they sent away, by the reason the client "
            "was told (too_large, server_topic, worker_stalled, session_ended, too_slow, ...)",
            ["reason"],
            registry=registry,
        )
        self._controls = Counter(
            "chunkline_controls",
            "Validated (accepted) control messages",
            registry=registry,
        )
        self._actions_overwritten = Counter(
            "chunkline_actions_overwritten",
            "Pending actions replaced by a newer control before their first frame",
            registry=registry,
        )
        self._chunks = Counter(
            "chunkline_chunks",
            "Chunks by result",
            ["result"],
            registry=registry,
        )
        self._frames_published = Counter(
            "chunkline_frames_published",
            "Frames published to transports",
            registry=registry,
        )
        self._sessions_finished = Counter(
            "chunkline_sessions_finished",
            "Sessions that reached a terminal status, by result",
            ["result"],
            registry=registry,
        )
        self._worker_restarts = Counter(
            "chunkline_worker_restarts",
            "Failed workers replaced by a fresh one",
            registry=registry,
        )
        self._sessions = Gauge(
            "chunkline_sessions",
            "Sessions by status",
            ["status"],
            registry=registry,
        )
        self._queue_depth = Gauge(
            "chunkline_queue_depth",
            "Sessions waiting in the admission queue",
            registry=registry,
        )
        self._workers = Gauge(
            "chunkline_workers",
            "Workers by state",
            ["state"],
            registry=registry,
        )
        self._worker_losses = Counter(
            "chunkline_worker_losses",
            f"Worker agents lost, by cause ({', '.join(LOSS_CAUSES)})",
            ["cause"],
            registry=registry,
        )
        self._stale_messages = Counter(
            "chunkline_cluster_stale_messages",
            "Messages from worker agents dropped as stale (a dead id, a late or duplicate session event)",
            registry=registry,
        )
        self._room_queued = Gauge(
            "chunkline_room_queued_bytes",
            "Text queued for the local rooms' sockets, all together (at most the server-wide backlog budget)",
            registry=registry,
        )
        self._capacity = Gauge(
            "chunkline_session_capacity",
            "Total retained-session capacity across workers",
            registry=registry,
        )
        self._chunk_latency = Histogram(
            "chunkline_chunk_latency_seconds",
            "Pipeline compute time per chunk",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._action_to_first_frame = Histogram(
            "chunkline_action_to_first_frame_seconds",
            "Validated control to the first frame published after it",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_PublishedFpsCollector(self))

        # Fixed label sets are exported from the start, at zero.
        for result in ADMISSION_RESULTS:
            self._admissions.labels(result=result)
        for result in CHUNK_RESULTS:
            self._chunks.labels(result=result)
        for result in FINISH_RESULTS:
            self._sessions_finished.labels(result=result)

    # -- recording -----------------------------------------------------------------------

    def record_worker_restart(self) -> None:
        self._worker_restarts.inc()

    def record_admission(self, result: str) -> None:
        _check_choice("admission result", result, ADMISSION_RESULTS)
        self._admissions.labels(result=result).inc()

    def record_control(self, session_key: str, *, at: float | None = None) -> None:
        """An accepted control: count it and start (or restart) the session's action timer."""
        stamp = self._clock() if at is None else at
        self._controls.inc()
        if session_key in self._pending_actions:
            self._actions_overwritten.inc()
        self._pending_actions[session_key] = stamp

    def record_control_rejection(self, reason: str, count: int = 1) -> None:
        """The worker answered ``control_rejected`` ``reason`` for ``count`` of a participant's messages."""
        _count_reason(self._control_rejections, "control rejection", reason, count)

    def record_room_refusal(self, reason: str, count: int = 1) -> None:
        """A local room told a client ``reason`` for ``count`` of its messages (or sent it away)."""
        _count_reason(self._room_refusals, "room refusal", reason, count)

    def record_chunk_processed(self, seconds: float | None) -> None:
        """A chunk the pipeline made; ``seconds``: its compute time, when the pipeline reported it (``stage_times``)."""
        if seconds is not None and not seconds >= 0:
            raise ValueError(f"chunk latency must be >= 0, got {seconds!r}")
        self._chunks.labels(result="processed").inc()
        if seconds is not None:
            self._chunk_latency.observe(seconds)

    def record_chunk_published(
        self, session_key: str, frames: int, at: float | None = None
    ) -> None:
        """A chunk of `frames` frames handed to the transport at `at` (default: now)."""
        self.record_frames_published(session_key, frames, at)  # (checks `frames` before it counts anything)
        self._chunks.labels(result="published").inc()

    def record_frames_published(self, session_key: str, frames: int, at: float | None = None) -> None:
        """`frames` frames handed to the transport at `at` (default: now): a whole chunk's, or those of a chunk cut
        short by the session's end (they reached the room, as its `done` message counts them)."""
        if frames < 0:
            raise ValueError(f"frames must be >= 0, got {frames!r}")
        stamp = self._clock() if at is None else at
        if frames == 0:
            return
        self._frames_published.inc(frames)
        self._fps.add(session_key, stamp, frames, self._clock())  # prunes as it goes, scraped or not
        pending = self._pending_actions.get(session_key)
        if pending is not None and stamp >= pending:
            del self._pending_actions[session_key]
            self._action_to_first_frame.observe(stamp - pending)

    def record_session_finished(self, session_key: str, result: str) -> None:
        """Count the terminal result and forget the session's pending action and fps window."""
        _check_choice("session result", result, FINISH_RESULTS)
        self._sessions_finished.labels(result=result).inc()
        self._pending_actions.pop(session_key, None)
        self._fps.forget(session_key)

    def set_sessions(self, counts: Mapping[str, int]) -> None:
        """Set `chunkline_sessions{status}`; a status seen before but absent here reads 0."""
        self._session_statuses.update(counts)
        for status in self._session_statuses:
            self._sessions.labels(status=status).set(counts.get(status, 0))

    def set_queue_depth(self, depth: int) -> None:
        self._queue_depth.set(depth)

    def set_workers(self, counts: Mapping[str, int]) -> None:
        """Set `chunkline_workers{state}`; a state seen before but absent here reads 0."""
        self._worker_states.update(counts)
        for state in self._worker_states:
            self._workers.labels(state=state).set(counts.get(state, 0))

    def record_worker_lost(self, cause: str) -> None:
        _check_choice("worker loss cause", cause, LOSS_CAUSES)
        self._worker_losses.labels(cause=cause).inc()

    def record_stale_messages(self, count: int = 1) -> None:
        self._stale_messages.inc(count)

    def watch_room_backlog(self, read: Callable[[], float]) -> None:
        """Read ``chunkline_room_queued_bytes`` from ``read`` at each scrape (the local rooms' budget count)."""
        self._room_queued.set_function(read)

    def set_capacity(self, capacity: int) -> None:
        self._capacity.set(capacity)

    # -- reading -------------------------------------------------------------------------

    @property
    def fps_window_seconds(self) -> float:
        return self._fps.window_seconds

    def uptime_seconds(self) -> float:
        return max(0.0, self._clock() - self._started_at)

    def pending_actions(self) -> int:
        """How many sessions have an action still waiting for its first frame."""
        return len(self._pending_actions)

    def published_fps(self) -> dict[str, float]:
        """The fps scopes over the trailing window ending now (see the module docstring)."""
        return self._fps.rates(self._clock())

    def prometheus_text(self) -> bytes:
        """The registry in the Prometheus text exposition format (see `CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def summary(self) -> dict[str, Any]:
        """A JSON-ready view of the same numbers the registry exports."""
        value = self.registry.get_sample_value

        def count(name: str, labels: Mapping[str, str] | None = None) -> int:
            return int(value(name, dict(labels or {})) or 0)

        rejections = {
            sample.labels["reason"]: int(sample.value)
            for metric in self._control_rejections.collect()
            for sample in metric.samples
            if sample.name == "chunkline_control_rejections_total"
        }
        return {
            "uptime_seconds": self.uptime_seconds(),
            "admissions": {
                result: count("chunkline_admissions_total", {"result": result})
                for result in ADMISSION_RESULTS
            },
            "sessions": {
                status: count("chunkline_sessions", {"status": status})
                for status in sorted(self._session_statuses)
            },
            "sessions_finished": {
                result: count("chunkline_sessions_finished_total", {"result": result})
                for result in FINISH_RESULTS
            },
            "queue_depth": count("chunkline_queue_depth"),
            "worker_restarts": count("chunkline_worker_restarts_total"),
            "workers": {
                state: count("chunkline_workers", {"state": state})
                for state in sorted(self._worker_states)
            },
            "capacity": count("chunkline_session_capacity"),
            "room_queued_bytes": count("chunkline_room_queued_bytes"),
            "controls": {
                "accepted": count("chunkline_controls_total"),
                "rejected": dict(sorted(rejections.items())),
                "actions_overwritten": count("chunkline_actions_overwritten_total"),
            },
            "chunks": {
                result: count("chunkline_chunks_total", {"result": result})
                for result in CHUNK_RESULTS
            },
            "frames_published": count("chunkline_frames_published_total"),
            "published_fps": {
                "window_seconds": self._fps.window_seconds,
                **self.published_fps(),
            },
            "chunk_latency_seconds": histogram_summary(self._chunk_latency),
            "action_to_first_frame_seconds": {
                key: item
                for key, item in histogram_summary(self._action_to_first_frame).items()
                if key in ("count", "mean")
            },
        }


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(choices)}")

"""What an offline run measures (:class:`Recorder`) and writes as ``metrics.json``; the run itself is
:mod:`pipelines.offline`.

Outputs
-------

``out_dir/video.mp4``: H.264 (libx264, yuv420p) at the chunks' fps (odd frame sizes are padded to even by
repeating the edge), with the chunks' PCM16 audio encoded as AAC when the first chunk carries audio (a later
chunk without audio gets silence). ``out_dir/metrics.json`` (times in seconds, measured with the wall clock):

- ``kind``, ``requested_chunks``, ``chunks``, ``frames``, ``fps``, ``width``, ``height``,
  ``chunk_media_seconds`` (mean media duration of a chunk), ``media_seconds``, ``wall_seconds``,
  ``ended_early`` (the service ended the stream before ``requested_chunks``), ``audio`` (``null`` or
  ``{sample_rate, channels, seconds}``);
- ``session_setup_seconds``: ``create_session`` (bidirectional) or ``stream()`` (server-push) call time;
- ``first_output_latency_seconds``: from the session request to the first chunk;
- ``chunk_period``: a latency summary (``count, minimum_seconds, p50_seconds, p95_seconds, maximum_seconds,
  mean_seconds``) of the gaps between consecutive chunk arrivals;
- ``real_time_factor``: p95 chunk period / chunk media duration (< 1: ahead of playback; ``null`` with one
  chunk);
- ``control_to_output_latency``: a latency summary of, per pushed control, the time from pushing it to the
  arrival of the chunk that applies it on the media clock (measurable for controls that were pushed and whose
  chunk arrived);
- ``controls``: ``{scheduled, pushed, rejected, not_reached, entries: [{entry, t, type, chunk,
  latency_seconds | rejected}]}``;
- ``stage_times``: ``{stage: {count, mean_seconds}}`` aggregated from ``chunk.metadata["stage_times"]`` (a
  mapping of stage to seconds, or to a mapping with ``seconds``/``duration_seconds``/``mean_seconds``);
- ``idle_reasons``: ``{reason: {count, idle_seconds}}`` aggregated from ``chunk.metadata["idle_reasons"]``
  (a list of reasons, of ``{reason, idle_seconds}`` mappings or objects, or a mapping of reason to count or
  of stage to reason); both are ``{}`` when chunks carry none;
- ``events``: ``{event type: count}`` of the service events a bidirectional session reported;
- ``audio_silent_chunks`` (chunks without audio filled with silence), ``audio_dropped_chunks`` (audio of later
  chunks dropped because the first chunk had none), ``video`` (``{file, codec, pix_fmt}``).

It is valid JSON whatever the chunks' metadata holds: a number past a float's range (a sum of idle seconds) is
``null``.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from engine.metrics import LatencySummary

from .contract import Chunk, ServiceEvent, check_event_session, check_service_event
from .mp4 import Mp4Writer
from .timed_controls import TimedControl

__all__ = ["CLOCK_TOLERANCE", "METRICS_NAME", "Recorder", "VIDEO_NAME", "metrics_text"]

VIDEO_NAME = "video.mp4"
METRICS_NAME = "metrics.json"
#: media times closer than this are the same instant (a control at ``t`` applies to a chunk starting at ``t``)
CLOCK_TOLERANCE = 1e-6


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _mean(samples: Sequence[float]) -> float:
    """The mean of finite samples, finite: their sum overflows past 1.8e308 (a stage time of 1e308 s in two chunks
    failed a finished run with ``OverflowError: intermediate overflow in fsum``)."""
    try:
        return math.fsum(samples) / len(samples)
    except OverflowError:
        return math.fsum(sample / len(samples) for sample in samples)


def _finite(value: Any) -> Any:
    """``value`` with every number that is not finite as ``None``: JSON has no infinity (a sum of idle seconds
    past 1.8e308 was written as ``Infinity``, which a JSON parser refuses, and the run exited 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def metrics_text(metrics: Mapping[str, Any]) -> str:
    """``metrics.json``'s text: valid JSON whatever numbers the pipeline's metadata brought."""
    return json.dumps(_finite(metrics), indent=2, sort_keys=False, allow_nan=False) + "\n"


class Recorder:
    """One run's measurements, as the chunks and controls come; :meth:`metrics` is ``metrics.json``."""

    def __init__(self, kind: str, requested: int, scheduled: int) -> None:
        self.kind = kind
        self.requested = requested
        self.scheduled = scheduled
        self.started = time.perf_counter()
        self.session_requested: float | None = None
        self.session_setup: float | None = None
        self.arrivals: list[float] = []
        self.chunk_media: list[float] = []
        self.frames = 0
        self.fps: float | None = None
        self.size: tuple[int, int] | None = None
        self.ended_early = False
        self.control_entries: list[dict[str, Any]] = []
        self._awaiting: list[tuple[dict[str, Any], float]] = []  # pushed, waiting for their chunk
        self.stage_samples: dict[str, list[float]] = {}
        self.idle: dict[str, dict[str, float]] = {}
        self.events: dict[str, int] = {}
        self._scripted: list[TimedControl] = []  # timeline controls not yet reached by a chunk
        self.session_id: str | None = None  # the pipeline's, once create_session returned it

    def pushed(self, timed: TimedControl, chunk: int, at: float) -> None:
        record = {"entry": timed.entry, "t": timed.t, "type": timed.control.type.value, "chunk": chunk}
        self.control_entries.append(record)
        self._awaiting.append((record, at))

    def rejected(self, timed: TimedControl, chunk: int, reason: str) -> None:
        self.control_entries.append(
            {"entry": timed.entry, "t": timed.t, "type": timed.control.type.value, "chunk": chunk, "rejected": reason}
        )

    def event(self, event: ServiceEvent) -> None:
        check_service_event(event)
        check_event_session(event, self.session_id)
        self.events[event.type] = self.events.get(event.type, 0) + 1

    def expect_scripted(self, controls: Sequence[TimedControl]) -> None:
        """Controls handed to the service up front (``SessionConfig.timeline``), in time order."""
        self._scripted = list(controls)

    def chunk(self, chunk: Chunk, at: float) -> None:
        start = math.fsum(self.chunk_media)  # media time at which this chunk starts
        measured = _number(chunk.metadata.get("control_to_output_seconds"))
        while self._scripted and self._scripted[0].t <= start + CLOCK_TOLERANCE:
            timed = self._scripted.pop(0)
            record = {"entry": timed.entry, "t": timed.t, "type": timed.control.type.value, "chunk": len(self.arrivals)}
            if measured is not None:
                record["latency_seconds"] = measured
            self.control_entries.append(record)
        self.arrivals.append(at)
        self.chunk_media.append(chunk.media_seconds)
        self.frames += chunk.frame_count
        if self.fps is None:
            self.fps = chunk.fps
            self.size = (int(chunk.frames.shape[2]), int(chunk.frames.shape[1]))
        for record, pushed_at in self._awaiting:
            record["latency_seconds"] = at - pushed_at
        self._awaiting.clear()
        self._stage_times(chunk.metadata.get("stage_times"))
        self._idle_reasons(chunk.metadata.get("idle_reasons"))

    def _stage_times(self, value: Any) -> None:
        if not isinstance(value, Mapping):
            return
        for stage, raw in value.items():
            seconds = _number(raw)
            if seconds is None and isinstance(raw, Mapping):
                for field in ("seconds", "duration_seconds", "mean_seconds"):
                    seconds = _number(raw.get(field))
                    if seconds is not None:
                        break
            if seconds is not None:
                self.stage_samples.setdefault(str(stage), []).append(seconds)

    def _idle(self, reason: Any, count: float = 1, seconds: float | None = None) -> None:
        if not isinstance(reason, str) or not reason:
            return
        entry = self.idle.setdefault(reason, {"count": 0, "idle_seconds": 0.0})
        entry["count"] += count
        if seconds is not None:
            entry["idle_seconds"] += seconds

    def _idle_reasons(self, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, Mapping):
            for key, raw in value.items():
                if isinstance(raw, str):  # stage -> reason
                    self._idle(raw)
                elif isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:  # reason -> count
                    self._idle(str(key), count=raw)
                elif isinstance(raw, Mapping | list | tuple):
                    self._idle_reasons(raw)
            return
        if isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, str):
                    self._idle(item)
                elif isinstance(item, Mapping):
                    self._idle(item.get("reason"), seconds=_number(item.get("idle_seconds")))
                elif hasattr(item, "reason"):
                    self._idle(item.reason, seconds=_number(getattr(item, "idle_seconds", None)))

    def metrics(self, writer: Mp4Writer) -> dict[str, Any]:
        periods = [b - a for a, b in itertools.pairwise(self.arrivals)]
        chunk_period = LatencySummary.from_samples(periods)
        latencies = [r["latency_seconds"] for r in self.control_entries if "latency_seconds" in r]
        media = math.fsum(self.chunk_media)
        chunk_media = media / len(self.chunk_media) if self.chunk_media else None
        rtf = None
        if chunk_period.p95_seconds is not None and chunk_media:
            rtf = chunk_period.p95_seconds / chunk_media
        first = None
        if self.arrivals and self.session_requested is not None:
            first = self.arrivals[0] - self.session_requested
        pushed = sum(1 for r in self.control_entries if "rejected" not in r)
        rejected = len(self.control_entries) - pushed
        return {
            "kind": self.kind,
            "requested_chunks": self.requested,
            "chunks": len(self.arrivals),
            "frames": self.frames,
            "fps": self.fps,
            "width": self.size[0] if self.size else None,
            "height": self.size[1] if self.size else None,
            "chunk_media_seconds": chunk_media,
            "media_seconds": media,
            "wall_seconds": time.perf_counter() - self.started,
            "ended_early": self.ended_early,
            "session_setup_seconds": self.session_setup,
            "first_output_latency_seconds": first,
            "chunk_period": attrs.asdict(chunk_period),
            "real_time_factor": rtf,
            "control_to_output_latency": attrs.asdict(LatencySummary.from_samples(latencies)),
            "controls": {
                "scheduled": self.scheduled,
                "pushed": pushed,
                "rejected": rejected,
                "not_reached": self.scheduled - len(self.control_entries),
                "entries": self.control_entries,
            },
            "stage_times": {
                stage: {"count": len(samples), "mean_seconds": _mean(samples)}
                for stage, samples in sorted(self.stage_samples.items())
            },
            "idle_reasons": {reason: dict(v) for reason, v in sorted(self.idle.items())},
            "events": dict(sorted(self.events.items())),
            "audio": writer.audio_info(),
            "audio_dropped_chunks": writer.audio_dropped_chunks,
            "audio_silent_chunks": writer.audio_silent_chunks,
            "video": {"file": VIDEO_NAME, "codec": "h264", "pix_fmt": "yuv420p"},
        }

"""Scheduler-observed timing: latency summaries, per-stage timings, idle attribution, counters."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs

__all__ = [
    "LatencySummary",
    "SessionMetrics",
    "StageTiming",
    "IdleInterval",
    "Diagnostics",
    "ArtifactStats",
    "idle_intervals",
]

CONTINUOUS_SECONDS = 0.001


@attrs.frozen
class LatencySummary:
    """Count, min, p50, p95, max and mean of a sample (percentiles interpolate linearly)."""

    count: int
    minimum_seconds: float | None = None
    p50_seconds: float | None = None
    p95_seconds: float | None = None
    maximum_seconds: float | None = None
    mean_seconds: float | None = None

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> LatencySummary:
        if not samples:
            return cls(count=0)
        ordered = sorted(samples)
        return cls(
            count=len(ordered),
            minimum_seconds=ordered[0],
            p50_seconds=percentile(ordered, 0.50),
            p95_seconds=percentile(ordered, 0.95),
            maximum_seconds=ordered[-1],
            mean_seconds=math.fsum(ordered) / len(ordered),
        )


def percentile(ordered: Sequence[float], fraction: float) -> float:
    """Linear interpolation between closest ranks of an already sorted sample."""
    if not ordered:
        raise ValueError("percentile of an empty sample")
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    weight = position - low
    return ordered[low] * (1.0 - weight) + ordered[high] * weight


@attrs.frozen
class SessionMetrics:
    ingress_accepted_at: tuple[tuple[int, float], ...]
    output_emitted_at: tuple[tuple[int, float], ...]
    first_output_latency_seconds: float | None
    control_to_output_latency: LatencySummary
    chunk_period: LatencySummary

    @classmethod
    def from_stamps(cls, ingress: Mapping[int, float], emitted: Mapping[int, float]) -> SessionMetrics:
        ingress_items = tuple(sorted(ingress.items()))
        emitted_items = tuple(sorted(emitted.items()))
        first = None
        if ingress_items and emitted_items:
            first = emitted_items[0][1] - ingress_items[0][1]
        latencies = [t - ingress[seq] for seq, t in emitted_items if seq in ingress]
        times = [t for _, t in emitted_items]
        periods = [b - a for a, b in zip(times, times[1:])]
        return cls(
            ingress_accepted_at=ingress_items,
            output_emitted_at=emitted_items,
            first_output_latency_seconds=first,
            control_to_output_latency=LatencySummary.from_samples(latencies),
            chunk_period=LatencySummary.from_samples(periods),
        )

    def real_time_factor(self, chunk_media_seconds: float) -> float | None:
        """p95 chunk period over the media duration of one chunk (< 1: ahead of playback)."""
        if chunk_media_seconds <= 0:
            raise ValueError("chunk_media_seconds must be > 0")
        if self.chunk_period.p95_seconds is None:
            return None
        return self.chunk_period.p95_seconds / chunk_media_seconds


@attrs.frozen
class StageTiming:
    stage_id: str
    sequence_id: int
    inputs_ready_at: float | None
    admitted_at: float | None
    completed_at: float | None


@attrs.frozen
class IdleInterval:
    """A gap between two admissions of one stage and why it happened."""

    stage_id: str
    previous_sequence_id: int
    sequence_id: int
    idle_seconds: float
    reason: str
    missing_inputs: tuple[str, ...]


@attrs.frozen
class Diagnostics:
    stale_epoch_results: int = 0
    orphaned_results: int = 0
    duplicate_results: int = 0
    cleanup_failures: int = 0
    slot_leaks: int = 0


@attrs.frozen
class ArtifactStats:
    slot_count: int
    reference_count: int


def idle_intervals(
    stage_id: str,
    timings: Sequence[StageTiming],
    missing_after: Mapping[int, tuple[str, ...]],
    blockers: Mapping[int, str],
) -> list[IdleInterval]:
    """Gaps between consecutive admissions of a stage, with a reason derived from the spec.

    ``missing_after[seq]`` names the inputs of ``seq`` that were absent when the
    stage's previous item completed; ``blockers[seq]`` is the limit that last
    held ``seq`` back once its inputs were ready.
    """
    done = [t for t in timings if t.admitted_at is not None and t.completed_at is not None]
    done.sort(key=lambda t: t.admitted_at)  # type: ignore[arg-type, return-value]
    intervals = []
    for previous, current in zip(done, done[1:]):
        idle = max(0.0, current.admitted_at - previous.completed_at)  # type: ignore[operator]
        missing = missing_after.get(current.sequence_id, ())
        if idle <= CONTINUOUS_SECONDS:
            reason = "continuous"
        elif missing:
            reason = "+".join(missing)
        else:
            reason = blockers.get(current.sequence_id, "scheduler_admission")
        intervals.append(
            IdleInterval(
                stage_id=stage_id,
                previous_sequence_id=previous.sequence_id,
                sequence_id=current.sequence_id,
                idle_seconds=idle,
                reason=reason,
                missing_inputs=missing if idle > CONTINUOUS_SECONDS else (),
            )
        )
    return intervals

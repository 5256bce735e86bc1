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
    "RunningSummary",
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


class RunningSummary:
    """A latency summary kept in bounded memory over a session of any length.

    Count, minimum, maximum and mean cover every sample; the percentiles cover
    the most recent ``window`` samples (all of them until the window fills).
    A sample is only appended (a stage's thread adds one per output); once a quarter
    window more than the window has gathered, the oldest are folded into the
    whole-session figures in one go, so memory stays under 1.25 windows and
    ``add`` stays cheap.
    """

    __slots__ = ("_window", "_fold_at", "_recent", "_folded", "_minimum", "_maximum", "_total", "_compensation")

    def __init__(self, window: int) -> None:
        self._window = window
        self._fold_at = window + max(1, window // 4)
        self._recent: list[float] = []  # the newest samples, fewer than ``_fold_at``
        self._folded = 0  # samples already folded into the figures below
        self._minimum = math.inf
        self._maximum = -math.inf
        self._total = 0.0
        self._compensation = 0.0  # Neumaier summation: the mean stays exact over long sessions

    def add(self, sample: float) -> None:
        recent = self._recent
        recent.append(sample)
        if len(recent) >= self._fold_at:
            self._fold(len(recent) - self._window)

    def _fold(self, count: int) -> None:
        """Fold the ``count`` oldest recent samples into the whole-session figures."""
        old = self._recent[:count]
        del self._recent[:count]
        self._folded += count
        self._minimum = min(self._minimum, *old)
        self._maximum = max(self._maximum, *old)
        self._total, self._compensation = _neumaier(self._total, self._compensation, math.fsum(old))

    @property
    def count(self) -> int:
        return self._folded + len(self._recent)

    def summary(self) -> LatencySummary:
        recent = self._recent
        if not self.count:
            return LatencySummary(count=0)
        total, compensation = _neumaier(self._total, self._compensation, math.fsum(recent))
        ordered = sorted(recent[-self._window:])
        return LatencySummary(
            count=self.count,
            minimum_seconds=min(self._minimum, *recent) if recent else self._minimum,
            p50_seconds=percentile(ordered, 0.50),
            p95_seconds=percentile(ordered, 0.95),
            maximum_seconds=max(self._maximum, *recent) if recent else self._maximum,
            mean_seconds=(total + compensation) / self.count,
        )


def _neumaier(total: float, compensation: float, value: float) -> tuple[float, float]:
    """Add ``value`` to a compensated sum (the running total and its lost low-order part)."""
    new_total = total + value
    if abs(total) >= abs(value):
        compensation += (total - new_total) + value
    else:
        compensation += (value - new_total) + total
    return new_total, compensation


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

    @classmethod
    def from_session(
        cls,
        ingress: Mapping[int, float],
        emitted: Mapping[int, float],
        *,
        first_ingress_at: float | None,
        first_emitted_at: float | None,
        control_to_output: RunningSummary,
        chunk_period: RunningSummary,
    ) -> SessionMetrics:
        """Metrics of a long session: recent per-sequence stamps, whole-session summaries."""
        first = None
        if first_ingress_at is not None and first_emitted_at is not None:
            first = first_emitted_at - first_ingress_at
        return cls(
            ingress_accepted_at=tuple(sorted(ingress.items())),
            output_emitted_at=tuple(sorted(emitted.items())),
            first_output_latency_seconds=first,
            control_to_output_latency=control_to_output.summary(),
            chunk_period=chunk_period.summary(),
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
    blockers: Mapping[int, object],
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
        elif missing and not _held_longer_by_a_limit(previous, current):
            reason = "+".join(missing)
        else:
            blocker = blockers.get(current.sequence_id)
            reason = "scheduler_admission" if blocker is None else str(blocker)
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


def _held_longer_by_a_limit(previous: StageTiming, current: StageTiming) -> bool:
    """Whether more of the gap passed once ``current``'s inputs were all there (a limit held it) than before: an
    input that came a moment after the previous call ended was blamed for all of a backpressured wait."""
    ready = current.inputs_ready_at
    if ready is None:
        return False
    return current.admitted_at - ready > ready - previous.completed_at  # type: ignore[operator]

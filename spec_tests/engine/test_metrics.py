"""Scheduler-observed timing (reference A.2 value types, A.9 metrics): pure functions of stamps."""

from __future__ import annotations

import attrs
import pytest

from engine.metrics import (
    CONTINUOUS_SECONDS,
    IdleInterval,
    LatencySummary,
    SessionMetrics,
    StageTiming,
    idle_intervals,
    percentile,
)

# -- LatencySummary ------------------------------------------------------------


def test_empty_sample_has_count_zero_and_no_values() -> None:
    summary = LatencySummary.from_samples([])
    assert summary == LatencySummary(count=0)
    assert summary.count == 0
    assert summary.minimum_seconds is None
    assert summary.p50_seconds is None
    assert summary.p95_seconds is None
    assert summary.maximum_seconds is None
    assert summary.mean_seconds is None


def test_single_sample_is_every_statistic() -> None:
    summary = LatencySummary.from_samples([0.25])
    assert summary == LatencySummary(1, 0.25, 0.25, 0.25, 0.25, 0.25)


def test_percentiles_interpolate_linearly_between_closest_ranks() -> None:
    # given out of order; sorted: 1, 2, 3, 4
    summary = LatencySummary.from_samples([4.0, 1.0, 3.0, 2.0])
    assert summary.count == 4
    assert summary.minimum_seconds == 1.0
    assert summary.maximum_seconds == 4.0
    # p50: rank (4 - 1) * 0.5 = 1.5 -> halfway between 2 and 3
    assert summary.p50_seconds == pytest.approx(2.5)
    # p95: rank 3 * 0.95 = 2.85 -> 3 + 0.85 * (4 - 3)
    assert summary.p95_seconds == pytest.approx(3.85)
    assert summary.mean_seconds == pytest.approx(2.5)


def test_percentile_on_an_exact_rank_is_that_sample() -> None:
    ordered = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(ordered, 0.5) == 30.0  # rank 2 exactly
    assert percentile(ordered, 0.0) == 10.0
    assert percentile(ordered, 1.0) == 50.0
    assert percentile(ordered, 0.95) == pytest.approx(48.0)  # rank 3.8


def test_percentile_of_empty_sample_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 0.5)


def test_p95_of_twenty_samples() -> None:
    samples = [float(i) for i in range(1, 21)]  # 1..20
    summary = LatencySummary.from_samples(samples)
    # rank 19 * 0.95 = 18.05 -> 19 + 0.05 * (20 - 19)
    assert summary.p95_seconds == pytest.approx(19.05)
    assert summary.p50_seconds == pytest.approx(10.5)
    assert summary.mean_seconds == pytest.approx(10.5)


def test_summary_is_frozen() -> None:
    summary = LatencySummary.from_samples([1.0])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        summary.count = 2  # type: ignore[misc]


# -- SessionMetrics.from_stamps ------------------------------------------------------


def test_session_metrics_from_stamps() -> None:
    ingress = {3: 4.0, 0: 1.0, 1: 2.0}  # sequence 2 has no ingress stamp
    emitted = {1: 2.75, 0: 1.5, 3: 4.25, 2: 3.5}
    metrics = SessionMetrics.from_stamps(ingress, emitted)

    # both sorted by sequence id
    assert metrics.ingress_accepted_at == ((0, 1.0), (1, 2.0), (3, 4.0))
    assert metrics.output_emitted_at == ((0, 1.5), (1, 2.75), (2, 3.5), (3, 4.25))

    assert metrics.first_output_latency_seconds == pytest.approx(0.5)

    # per-sequence latency only for stamped sequences: 0, 1 and 3
    latency = metrics.control_to_output_latency
    assert latency.count == 3
    assert latency.minimum_seconds == pytest.approx(0.25)
    assert latency.maximum_seconds == pytest.approx(0.75)
    assert latency.p50_seconds == pytest.approx(0.5)
    assert latency.mean_seconds == pytest.approx(0.5)

    # chunk periods: differences between consecutive emitted times, in sequence order
    period = metrics.chunk_period
    assert period.count == 3
    assert period.minimum_seconds == pytest.approx(0.75)
    assert period.maximum_seconds == pytest.approx(1.25)
    assert period.mean_seconds == pytest.approx((1.25 + 0.75 + 0.75) / 3)


def test_first_output_latency_uses_lowest_stamped_sequence() -> None:
    # sequence 0 was never stamped (e.g. condition-only ingress under a latency anchor)
    metrics = SessionMetrics.from_stamps({1: 10.0, 2: 11.0}, {0: 10.5, 1: 10.75, 2: 11.5})
    assert metrics.first_output_latency_seconds == pytest.approx(0.5)
    assert metrics.control_to_output_latency.count == 2
    assert metrics.control_to_output_latency.minimum_seconds == pytest.approx(0.5)
    assert metrics.control_to_output_latency.maximum_seconds == pytest.approx(0.75)


def test_no_output_yet() -> None:
    metrics = SessionMetrics.from_stamps({0: 1.0}, {})
    assert metrics.first_output_latency_seconds is None
    assert metrics.output_emitted_at == ()
    assert metrics.control_to_output_latency == LatencySummary(count=0)
    assert metrics.chunk_period == LatencySummary(count=0)


def test_no_stamps_at_all() -> None:
    metrics = SessionMetrics.from_stamps({}, {})
    assert metrics.ingress_accepted_at == ()
    assert metrics.first_output_latency_seconds is None
    assert metrics.control_to_output_latency.count == 0
    assert metrics.chunk_period.count == 0


def test_one_output_has_a_latency_but_no_period() -> None:
    metrics = SessionMetrics.from_stamps({0: 1.0}, {0: 1.25})
    assert metrics.first_output_latency_seconds == pytest.approx(0.25)
    assert metrics.control_to_output_latency.count == 1
    assert metrics.chunk_period == LatencySummary(count=0)


# -- real-time factor -------------------------------------------------------------------


def test_real_time_factor_is_p95_period_over_chunk_media_duration() -> None:
    # periods 0.25 x 19 and one 0.5: p95 = rank 19 * 0.95 = 18.05 between 0.25 and 0.5
    emitted = {i: 0.25 * i for i in range(20)}
    emitted[20] = emitted[19] + 0.5
    metrics = SessionMetrics.from_stamps({}, emitted)
    p95 = metrics.chunk_period.p95_seconds
    assert p95 == pytest.approx(0.25 + 0.05 * 0.25)
    assert metrics.real_time_factor(0.5) == pytest.approx(p95 / 0.5)
    assert metrics.real_time_factor(0.5) < 1  # generation keeps ahead of playback
    assert metrics.real_time_factor(0.125) > 1  # falls behind


def test_real_time_factor_without_periods_is_none() -> None:
    assert SessionMetrics.from_stamps({0: 0.0}, {0: 1.0}).real_time_factor(0.5) is None


@pytest.mark.parametrize("media_seconds", [0.0, -1.0])
def test_real_time_factor_needs_a_positive_chunk_duration(media_seconds: float) -> None:
    metrics = SessionMetrics.from_stamps({}, {0: 1.0, 1: 2.0})
    with pytest.raises(ValueError, match="chunk_media_seconds"):
        metrics.real_time_factor(media_seconds)


# -- idle intervals --------------------------------------------------------------------


def timing(seq: int, admitted: float | None, completed: float | None) -> StageTiming:
    return StageTiming("decode", seq, inputs_ready_at=None, admitted_at=admitted, completed_at=completed)


def test_back_to_back_admissions_are_continuous() -> None:
    timings = [timing(0, 0.0, 1.0), timing(1, 1.0, 2.0)]
    (interval,) = idle_intervals("decode", timings, {}, {})
    assert interval == IdleInterval("decode", 0, 1, 0.0, "continuous", ())


def test_gap_within_one_millisecond_is_continuous_even_with_missing_inputs() -> None:
    gap = 2**-10  # 0.9765625 ms, exactly representable
    assert gap <= CONTINUOUS_SECONDS
    timings = [timing(0, 0.0, 1.0), timing(1, 1.0 + gap, 2.0)]
    (interval,) = idle_intervals("decode", timings, {1: ("condition",)}, {1: "resource_group"})
    assert interval.reason == "continuous"
    assert interval.idle_seconds == gap
    assert interval.missing_inputs == ()


def test_overlapping_admission_is_clamped_to_zero_idle() -> None:
    # an unordered stage admitted sequence 1 before sequence 0 completed
    timings = [timing(0, 0.0, 2.0), timing(1, 1.0, 3.0)]
    (interval,) = idle_intervals("decode", timings, {}, {})
    assert interval.idle_seconds == 0.0
    assert interval.reason == "continuous"


def test_missing_inputs_are_the_reason_joined_by_plus() -> None:
    timings = [timing(0, 0.0, 1.0), timing(1, 1.5, 2.0), timing(2, 2.25, 3.0)]
    missing = {1: ("condition", "control"), 2: ("latent",)}
    blockers = {1: "max_in_flight_global"}  # missing inputs take precedence
    first, second = idle_intervals("decode", timings, missing, blockers)
    assert first == IdleInterval("decode", 0, 1, 0.5, "condition+control", ("condition", "control"))
    assert second == IdleInterval("decode", 1, 2, 0.25, "latent", ("latent",))


def test_recorded_blocker_is_the_reason_when_inputs_were_ready() -> None:
    timings = [timing(0, 0.0, 1.0), timing(1, 1.5, 2.0)]
    (interval,) = idle_intervals("decode", timings, {}, {1: "resource_group:gpu"})
    assert interval == IdleInterval("decode", 0, 1, 0.5, "resource_group:gpu", ())


def test_default_reason_is_scheduler_admission() -> None:
    timings = [timing(0, 0.0, 1.0), timing(1, 1.5, 2.0)]
    (interval,) = idle_intervals("decode", timings, {}, {0: "not this sequence"})
    assert interval.reason == "scheduler_admission"
    assert interval.missing_inputs == ()


def test_intervals_follow_admission_order_and_skip_incomplete_timings() -> None:
    timings = [
        timing(2, 3.0, 4.0),
        timing(0, 0.0, 1.0),
        timing(3, 5.0, None),  # still running
        timing(4, None, None),  # never admitted
        timing(1, 1.5, 2.5),
    ]
    intervals = idle_intervals("decode", timings, {}, {})
    assert [(i.previous_sequence_id, i.sequence_id) for i in intervals] == [(0, 1), (1, 2)]
    assert [i.idle_seconds for i in intervals] == [0.5, 0.5]
    assert all(i.stage_id == "decode" for i in intervals)


def test_fewer_than_two_admissions_have_no_intervals() -> None:
    assert idle_intervals("decode", [], {}, {}) == []
    assert idle_intervals("decode", [timing(0, 0.0, 1.0)], {}, {}) == []

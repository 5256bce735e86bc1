"""Serving metrics (reference B.12, F.17): names, labels, fps window, action timer, isolation."""

from __future__ import annotations

import json
import math

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import CONTENT_TYPE, LATENCY_BUCKETS, ServerMetrics
from server.published_fps import nearest_rank


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def families(metrics: ServerMetrics) -> dict[str, prometheus_client.Metric]:
    text = metrics.prometheus_text().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = metrics.prometheus_text().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset(labels.items()))]


def label_sets(metrics: ServerMetrics, family: str, sample: str) -> set[frozenset[tuple[str, str]]]:
    return {
        frozenset(s.labels.items()) for s in families(metrics)[family].samples if s.name == sample
    }


# -- exposition: names, types, labels -------------------------------------------------


def test_content_type_is_the_classic_text_format() -> None:
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert CONTENT_TYPE == prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4


def test_every_family_is_exposed_with_its_type() -> None:
    found = {
        name: family.type for name, family in families(ServerMetrics(clock=FakeClock())).items()
    }
    expected = {
        "chunkline_admissions": "counter",
        "chunkline_control_rejections": "counter",
        "chunkline_controls": "counter",
        "chunkline_actions_overwritten": "counter",
        "chunkline_chunks": "counter",
        "chunkline_frames_published": "counter",
        "chunkline_sessions_finished": "counter",
        "chunkline_sessions": "gauge",
        "chunkline_queue_depth": "gauge",
        "chunkline_workers": "gauge",
        "chunkline_session_capacity": "gauge",
        "chunkline_uptime_seconds": "gauge",
        "chunkline_published_fps": "gauge",
        "chunkline_chunk_latency_seconds": "histogram",
        "chunkline_action_to_first_frame_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert found.get(name) == kind, name
    assert all(name.startswith("chunkline_") for name in found)


def test_fixed_label_sets_start_at_zero() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    assert label_sets(metrics, "chunkline_admissions", "chunkline_admissions_total") == {
        frozenset({("result", r)}) for r in ("assigned", "queued", "rejected")
    }
    assert label_sets(metrics, "chunkline_chunks", "chunkline_chunks_total") == {
        frozenset({("result", r)}) for r in ("processed", "published")
    }
    assert label_sets(
        metrics, "chunkline_sessions_finished", "chunkline_sessions_finished_total"
    ) == {frozenset({("result", r)}) for r in ("closed", "failed", "expired")}
    assert label_sets(metrics, "chunkline_published_fps", "chunkline_published_fps") == {
        frozenset({("scope", s)})
        for s in (
            "aggregate",
            "per_session_mean",
            "per_session_p50",
            "per_session_p95",
            "per_session_min",
        )
    }
    assert value(metrics, "chunkline_admissions_total", result="queued") == 0.0


def test_counters_count_by_label() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    for result in ("assigned", "assigned", "queued", "rejected"):
        metrics.record_admission(result)
    metrics.record_control_rejection("not_controller")
    metrics.record_control_rejection("not_controller")
    metrics.record_control_rejection("invalid_json")
    metrics.record_control_rejection("dropped", 7)  # one answer for the 7 messages a sender's newest replaced
    metrics.record_control("s1")
    metrics.record_control("s2")
    metrics.record_chunk_processed(0.02)
    metrics.record_chunk_published("s1", 16)
    metrics.record_chunk_published("s2", 8)
    metrics.record_session_finished("s1", "closed")
    metrics.record_session_finished("s2", "expired")

    assert value(metrics, "chunkline_admissions_total", result="assigned") == 2
    assert value(metrics, "chunkline_admissions_total", result="queued") == 1
    assert value(metrics, "chunkline_admissions_total", result="rejected") == 1
    assert value(metrics, "chunkline_control_rejections_total", reason="not_controller") == 2
    assert value(metrics, "chunkline_control_rejections_total", reason="invalid_json") == 1
    assert value(metrics, "chunkline_control_rejections_total", reason="dropped") == 7
    assert value(metrics, "chunkline_controls_total") == 2
    assert value(metrics, "chunkline_chunks_total", result="processed") == 1
    assert value(metrics, "chunkline_chunks_total", result="published") == 2
    assert value(metrics, "chunkline_frames_published_total") == 24
    assert value(metrics, "chunkline_sessions_finished_total", result="closed") == 1
    assert value(metrics, "chunkline_sessions_finished_total", result="expired") == 1
    assert value(metrics, "chunkline_sessions_finished_total", result="failed") == 0


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        ("record_admission", "maybe"),
        ("record_control_rejection", ""),
        ("record_chunk_processed", -0.1),
    ],
)
def test_out_of_vocabulary_values_are_refused(call: str, arg: object) -> None:
    with pytest.raises(ValueError):
        getattr(ServerMetrics(clock=FakeClock()), call)(arg)


@pytest.mark.parametrize("count", [0, -1, True, 1.5])
def test_a_rejection_count_below_one_or_not_an_int_is_refused(count: object) -> None:
    with pytest.raises(ValueError, match="count"):
        ServerMetrics(clock=FakeClock()).record_control_rejection("dropped", count)  # type: ignore[arg-type]


def test_unknown_finish_result_and_negative_frames_are_refused() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    with pytest.raises(ValueError):
        metrics.record_session_finished("s1", "vanished")
    with pytest.raises(ValueError):
        metrics.record_chunk_published("s1", -1)
    with pytest.raises(ValueError):
        ServerMetrics(fps_window_seconds=0)


def test_gauges_follow_the_latest_snapshot() -> None:
    clock = FakeClock(100.0)
    metrics = ServerMetrics(clock=clock)
    metrics.set_sessions({"running": 3, "queued": 2})
    metrics.set_workers({"idle": 1, "busy": 2})
    metrics.set_queue_depth(2)
    metrics.set_capacity(8)
    clock.now = 112.5

    assert value(metrics, "chunkline_sessions", status="running") == 3
    assert value(metrics, "chunkline_sessions", status="queued") == 2
    assert value(metrics, "chunkline_workers", state="busy") == 2
    assert value(metrics, "chunkline_queue_depth") == 2
    assert value(metrics, "chunkline_session_capacity") == 8
    assert value(metrics, "chunkline_uptime_seconds") == 12.5

    # A status (or worker state) missing from the next snapshot reads 0, not its stale count.
    metrics.set_sessions({"running": 1, "draining": 1})
    metrics.set_workers({"busy": 1, "failed": 1})
    assert value(metrics, "chunkline_sessions", status="queued") == 0
    assert value(metrics, "chunkline_sessions", status="running") == 1
    assert value(metrics, "chunkline_sessions", status="draining") == 1
    assert value(metrics, "chunkline_workers", state="idle") == 0
    assert value(metrics, "chunkline_workers", state="failed") == 1


def test_histograms_use_the_latency_buckets() -> None:
    metrics = ServerMetrics(clock=FakeClock())
    metrics.record_chunk_processed(0.03)
    metrics.record_chunk_processed(0.3)
    assert LATENCY_BUCKETS == (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 10)
    for family in ("chunkline_chunk_latency_seconds", "chunkline_action_to_first_frame_seconds"):
        bounds = [
            float(dict(labels)["le"]) for labels in label_sets(metrics, family, f"{family}_bucket")
        ]
        assert sorted(bounds) == [*LATENCY_BUCKETS, math.inf]
    assert value(metrics, "chunkline_chunk_latency_seconds_bucket", le="0.025") == 0
    assert value(metrics, "chunkline_chunk_latency_seconds_bucket", le="0.05") == 1
    assert value(metrics, "chunkline_chunk_latency_seconds_bucket", le="0.5") == 2
    assert value(metrics, "chunkline_chunk_latency_seconds_count") == 2
    assert value(metrics, "chunkline_chunk_latency_seconds_sum") == pytest.approx(0.33)


# -- published fps over the trailing window --------------------------------------------


def fps(metrics: ServerMetrics) -> dict[str, float]:
    return {
        dict(key)["scope"]: v
        for (name, key), v in samples(metrics).items()
        if name == "chunkline_published_fps"
    }


def timeline() -> tuple[FakeClock, ServerMetrics]:
    """Window 10 s. By t=10: a 20 frames, b 10, c 30, d 40 (rates 2, 1, 3, 4 fps)."""
    clock = FakeClock()
    metrics = ServerMetrics(clock=clock, fps_window_seconds=10.0)
    metrics.record_chunk_published("a", 10, at=1.0)
    metrics.record_chunk_published("b", 5, at=2.0)
    metrics.record_chunk_published("a", 10, at=5.0)
    metrics.record_chunk_published("c", 30, at=6.0)
    metrics.record_chunk_published("b", 5, at=8.0)
    metrics.record_chunk_published("d", 40, at=9.0)
    clock.now = 10.0
    return clock, metrics


def test_fps_scopes_on_a_hand_made_timeline() -> None:
    _, metrics = timeline()
    # Per-session rates, ascending: 1, 2, 3, 4. Nearest rank: p50 = rank 2, p95 = rank 4
    # (linear interpolation would give 2.5 and 3.85).
    assert fps(metrics) == {
        "aggregate": 10.0,
        "per_session_mean": 2.5,
        "per_session_p50": 2.0,
        "per_session_p95": 4.0,
        "per_session_min": 1.0,
    }
    assert metrics.published_fps() == fps(metrics)


def test_frames_older_than_the_window_fall_out() -> None:
    clock, metrics = timeline()
    clock.now = 12.0  # window (2, 12]: a's t=1 chunk and b's t=2 chunk (on the edge) leave
    assert fps(metrics) == pytest.approx(
        {
            "aggregate": 8.5,
            "per_session_mean": 2.125,  # rates 0.5, 1, 3, 4
            "per_session_p50": 1.0,
            "per_session_p95": 4.0,
            "per_session_min": 0.5,
        }
    )
    clock.now = 18.5  # only d's t=9 chunk remains
    assert fps(metrics) == dict.fromkeys(fps(metrics), 4.0)
    clock.now = 19.0 + 10.0
    assert fps(metrics) == dict.fromkeys(fps(metrics), 0.0)


def test_finished_sessions_leave_the_per_session_scopes_but_not_the_aggregate() -> None:
    _, metrics = timeline()
    metrics.record_session_finished("d", "closed")
    got = fps(metrics)
    assert got["aggregate"] == 10.0
    assert (got["per_session_min"], got["per_session_p50"], got["per_session_p95"]) == (
        1.0,
        2.0,
        3.0,
    )
    assert got["per_session_mean"] == 2.0


def test_fps_with_no_frames_reads_zero() -> None:
    assert set(fps(ServerMetrics(clock=FakeClock())).values()) == {0.0}


def test_nearest_rank_quantiles() -> None:
    sample = [1.0, 2.0, 3.0, 4.0]
    assert nearest_rank(sample, 0.0) == 1.0
    assert nearest_rank(sample, 0.25) == 1.0
    assert nearest_rank(sample, 0.5) == 2.0
    assert nearest_rank(sample, 0.51) == 3.0
    assert nearest_rank(sample, 0.95) == 4.0
    assert nearest_rank(sample, 1.0) == 4.0
    assert nearest_rank([7.0], 0.95) == 7.0
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)
    with pytest.raises(ValueError):
        nearest_rank(sample, 1.5)


# -- action to first frame ---------------------------------------------------------------


def test_action_to_first_frame_keeps_one_pending_action_per_session() -> None:
    clock = FakeClock(1.0)
    metrics = ServerMetrics(clock=clock)
    metrics.record_control("a")
    clock.now = 1.5
    metrics.record_control("a")  # overwrites the t=1.0 action
    metrics.record_control("b", at=1.6)
    assert metrics.pending_actions() == 2
    assert value(metrics, "chunkline_actions_overwritten_total") == 1
    assert value(metrics, "chunkline_controls_total") == 3

    metrics.record_chunk_published("a", 0, at=1.8)  # no frames: not a first frame
    metrics.record_chunk_published("b", 4, at=1.55)  # before b's action: not after it
    metrics.record_chunk_published("a", 4, at=1.75)
    assert value(metrics, "chunkline_action_to_first_frame_seconds_count") == 1
    assert value(metrics, "chunkline_action_to_first_frame_seconds_sum") == pytest.approx(0.25)

    metrics.record_chunk_published("a", 4, at=2.0)  # later frames resolve nothing
    metrics.record_chunk_published("b", 4, at=2.0)
    assert value(metrics, "chunkline_action_to_first_frame_seconds_count") == 2
    assert value(metrics, "chunkline_action_to_first_frame_seconds_sum") == pytest.approx(0.65)
    assert value(metrics, "chunkline_action_to_first_frame_seconds_bucket", le="0.25") == 1
    assert value(metrics, "chunkline_action_to_first_frame_seconds_bucket", le="0.5") == 2
    assert metrics.pending_actions() == 0


def test_finishing_a_session_drops_its_pending_action() -> None:
    clock = FakeClock(0.0)
    metrics = ServerMetrics(clock=clock)
    metrics.record_control("gone")
    metrics.record_session_finished("gone", "failed")
    assert metrics.pending_actions() == 0
    clock.now = 1.0
    metrics.record_chunk_published("gone", 4)  # a stray late chunk starts no latency sample
    assert value(metrics, "chunkline_action_to_first_frame_seconds_count") == 0


# -- cardinality and isolation -----------------------------------------------------------


def test_session_ids_never_appear_in_the_exposition() -> None:
    clock = FakeClock()
    metrics = ServerMetrics(clock=clock)
    ids = ["sess-3f9c2a7e41b0", "sess-aa01bb02cc03", "room-77d1e2f3"]
    for i, key in enumerate(ids):
        metrics.record_admission("assigned")
        metrics.record_control(key, at=float(i))
        metrics.record_control(key, at=float(i) + 0.1)
        metrics.record_chunk_published(key, 16, at=float(i) + 0.5)
    metrics.record_control(ids[0], at=5.0)  # still pending at collection time
    metrics.record_session_finished(ids[1], "closed")
    clock.now = 6.0
    text = metrics.prometheus_text().decode()
    summary = json.dumps(metrics.summary())
    for key in ids:
        assert key not in text
        assert key not in summary
    allowed = {"result", "reason", "status", "state", "scope", "le"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= allowed, sample


def test_two_instances_do_not_share_state() -> None:
    first = ServerMetrics(clock=FakeClock())
    second = ServerMetrics(clock=FakeClock())
    assert first.registry is not second.registry
    first.record_admission("assigned")
    first.record_control("s1", at=0.0)
    first.record_chunk_published("s1", 16, at=0.5)
    first.set_sessions({"running": 1})
    assert value(first, "chunkline_admissions_total", result="assigned") == 1
    assert value(second, "chunkline_admissions_total", result="assigned") == 0
    assert value(second, "chunkline_frames_published_total") == 0
    assert value(second, "chunkline_action_to_first_frame_seconds_count") == 0
    assert ("chunkline_sessions", frozenset({("status", "running")})) not in samples(second)
    # Nothing lands on the process-global registry.
    assert (
        prometheus_client.REGISTRY.get_sample_value(
            "chunkline_admissions_total", {"result": "assigned"}
        )
        is None
    )
    global_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "chunkline_" not in global_text


# -- JSON summary --------------------------------------------------------------------------


def test_summary_matches_the_exposition() -> None:
    clock = FakeClock(50.0)
    metrics = ServerMetrics(clock=clock, fps_window_seconds=10.0)
    for result in ("assigned", "queued", "queued", "rejected"):
        metrics.record_admission(result)
    metrics.record_control_rejection("rate_limited")
    metrics.record_control_rejection("not_controller")
    metrics.record_control_rejection("rate_limited")
    metrics.record_control("a", at=50.0)
    metrics.record_control("a", at=50.1)
    for seconds in (0.03, 0.03, 0.03, 0.3):
        metrics.record_chunk_processed(seconds)
    metrics.record_chunk_published("a", 16, at=50.5)
    metrics.record_chunk_published("b", 24, at=51.0)
    metrics.record_session_finished("b", "closed")
    metrics.set_sessions({"running": 1, "queued": 2})
    metrics.set_queue_depth(2)
    metrics.set_workers({"busy": 1, "idle": 1})
    metrics.set_capacity(4)
    clock.now = 60.0

    summary = metrics.summary()
    json.dumps(summary)  # JSON-ready
    got = samples(metrics)

    def v(name: str, **labels: str) -> float:
        return got[(name, frozenset(labels.items()))]

    assert summary["uptime_seconds"] == 10.0 == v("chunkline_uptime_seconds")
    assert summary["admissions"] == {"assigned": 1, "queued": 2, "rejected": 1}
    for result, n in summary["admissions"].items():
        assert v("chunkline_admissions_total", result=result) == n
    assert summary["sessions"] == {"queued": 2, "running": 1}
    assert summary["queue_depth"] == 2 == v("chunkline_queue_depth")
    assert summary["workers"] == {"busy": 1, "idle": 1}
    assert summary["capacity"] == 4 == v("chunkline_session_capacity")
    assert summary["controls"] == {
        "accepted": 2,
        "rejected": {"not_controller": 1, "rate_limited": 2},
        "actions_overwritten": 1,
    }
    assert summary["chunks"] == {"processed": 4, "published": 2}
    assert summary["frames_published"] == 40 == v("chunkline_frames_published_total")
    assert summary["sessions_finished"] == {"closed": 1, "failed": 0, "expired": 0}
    assert summary["published_fps"] == {"window_seconds": 10.0, **fps(metrics)}
    assert summary["published_fps"]["aggregate"] == 4.0
    assert summary["published_fps"]["per_session_mean"] == 1.6  # only "a" is live

    latency = summary["chunk_latency_seconds"]
    assert latency["count"] == 4 == v("chunkline_chunk_latency_seconds_count")
    assert latency["mean"] == pytest.approx(v("chunkline_chunk_latency_seconds_sum") / 4)
    # Bucket estimates, interpolated like PromQL's histogram_quantile.
    assert latency["p50"] == pytest.approx(0.025 + 0.025 * 2 / 3)
    assert latency["p95"] == pytest.approx(0.25 + 0.25 * 0.8)
    assert summary["action_to_first_frame_seconds"] == {
        "count": 1,
        "mean": pytest.approx(0.4),
    }


def test_summary_of_a_fresh_instance() -> None:
    summary = ServerMetrics(clock=FakeClock()).summary()
    assert summary["chunk_latency_seconds"] == {"count": 0, "mean": None, "p50": None, "p95": None}
    assert summary["action_to_first_frame_seconds"] == {"count": 0, "mean": None}
    assert summary["sessions"] == {}
    assert summary["controls"]["rejected"] == {}

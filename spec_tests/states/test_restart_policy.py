"""The restart policy (states/restart_policy.py): backoff, crash-loop limit, window, table-driven and
against a plain reference model (Hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from states.machine import IllegalTransition
from states.restart_policy import Event, RestartPolicy, RestartTracker, State

POLICY = RestartPolicy(base_delay=1.0, max_delay=8.0, factor=2.0, max_failures=4, window=100.0)


@pytest.mark.parametrize(
    ("failures", "delay"), [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (50, 8.0), (5000, 8.0)]
)
def test_the_delay_doubles_up_to_its_cap(failures: int, delay: float) -> None:
    assert POLICY.delay(failures) == delay


@pytest.mark.parametrize(
    ("field", "value"),
    [("base_delay", 0), ("base_delay", -1.0), ("max_delay", float("inf")), ("factor", float("nan")),
     ("max_failures", -1), ("max_failures", 1.5), ("window", 0), ("base_delay", True)],
)
def test_a_bad_policy_value_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**{field: value})


def test_max_delay_below_base_and_a_shrinking_factor_are_refused() -> None:
    with pytest.raises(ValueError, match="max_delay"):
        RestartPolicy(base_delay=5, max_delay=1)
    with pytest.raises(ValueError, match="factor"):
        RestartPolicy(factor=0.5)


# (time of the failure, time the replacement is started or None) -> expected (event, delay)
SCRIPT = [
    (0.0, 1.0, Event.FAILED, 1.0),
    (5.0, 7.0, Event.FAILED, 2.0),
    (10.0, 14.0, Event.FAILED, 4.0),
    (20.0, 28.0, Event.FAILED, 8.0),
    (30.0, None, Event.CRASH_LOOP, None),  # the fifth failure within 100 s
]


def test_a_crash_loop_gives_up_and_says_why() -> None:
    tracker = RestartTracker(POLICY)
    for failed_at, restart_at, event, delay in SCRIPT:
        decision = tracker.failure(failed_at, f"exit code -9 at {failed_at:g}")
        assert (decision.event, decision.delay) == (event, delay), decision
        if restart_at is not None:
            assert tracker.state is State.BACKING_OFF
            assert not tracker.due(restart_at - 0.001)
            assert tracker.retry_after(failed_at) == delay
            assert "restarting in" in (tracker.describe(failed_at) or "")
            tracker.restarted(restart_at)
            assert tracker.state is State.RUNNING and tracker.describe(restart_at) is None
    assert tracker.state is State.GAVE_UP and tracker.restarts == 4
    assert tracker.retry_after(31.0) is None and not tracker.due(10_000.0)
    description = tracker.describe(31.0)
    assert description is not None and "crash loop" in description and "exit code -9 at 30" in description
    with pytest.raises(IllegalTransition):
        tracker.failure(40.0, "again")  # a slot that gave up stays so


def test_a_refused_configuration_gives_up_at_once_whatever_failed_before() -> None:
    """A worker that refused its settings would be refused again by every replacement: no backoff, no restarts."""
    tracker = RestartTracker(POLICY)
    decision = tracker.failure(1.0, "exit code 1")
    assert decision.event is Event.FAILED
    tracker.restarted(decision.due_at)
    refused = tracker.failure(5.0, "max_sessions_per_worker=2 is refused", permanent=True)
    assert (refused.event, refused.delay, refused.due_at) == (Event.REFUSED, None, None)
    assert tracker.state is State.GAVE_UP and tracker.retry_after(5.0) is None and not tracker.due(10_000.0)
    assert tracker.describe(6.0) == "refused its configuration; not restarted (max_sessions_per_worker=2 is refused)"
    with pytest.raises(IllegalTransition):
        tracker.failure(7.0, "again", permanent=True)


def test_a_load_that_fails_as_the_last_one_did_gives_up_while_no_worker_ever_loaded() -> None:
    """A pipeline that raises as it is imported or built fails every load alike: the second such failure ends the
    restarts (it was retried up to the crash-loop limit, about 30 s of backoff, saying the same each time)."""
    tracker = RestartTracker(POLICY)
    first = tracker.failure(0.0, "ImportError: no module named 'torchh'", load_failure=("ImportError", "torchh"))
    assert first.event is Event.FAILED
    # its line says what ends it first: "restart 1 of 5" alone promised four more restarts that never come
    assert first.reason.endswith("in 1 s; a repeat of the same load failure ends it"), first.reason
    tracker.restarted(first.due_at)  # type: ignore[arg-type]
    again = tracker.failure(1.5, "ImportError: no module named 'torchh'", load_failure=("ImportError", "torchh"))
    assert (again.event, again.delay, again.due_at) == (Event.LOAD_REPEATED, None, None)
    assert tracker.state is State.GAVE_UP and tracker.retry_after(2.0) is None and tracker.restarts == 1
    assert tracker.describe(2.0) == ("the pipeline never loaded: it failed the same way twice in a row "
                                     "(ImportError: no module named 'torchh'); not restarted")


@pytest.mark.parametrize(("loaded", "second"), [
    (True, ("OSError", "disk")),  # a worker of the slot loaded once: a failure now is a crash, retried
    (False, ("OSError", "network")),  # a load that failed otherwise than the last one may be a passing fault
    (False, None),  # a failure that says nothing of the next load (it timed out)
])
def test_a_load_failure_is_retried_when_a_worker_loaded_before_or_it_failed_otherwise(
    loaded: bool, second: tuple[str, str] | None,
) -> None:
    tracker = RestartTracker(POLICY)
    if loaded:
        tracker.loaded()
    tracker.restarted(tracker.failure(0.0, "OSError", load_failure=("OSError", "disk")).due_at)  # type: ignore[arg-type]
    decision = tracker.failure(5.0, "OSError", load_failure=second)
    assert (decision.event, decision.delay) == (Event.FAILED, 2.0)
    assert tracker.state is State.BACKING_OFF
    # a repeat would end it only while no worker of the slot loaded and this failure was a load's
    assert decision.reason.endswith("a repeat of the same load failure ends it") is (not loaded and second is not None)


def test_failures_older_than_the_window_are_forgotten() -> None:
    tracker = RestartTracker(POLICY)
    for at in (0.0, 10.0, 20.0):
        tracker.failure(at, "boom")
        tracker.restarted(tracker.due_at)  # type: ignore[arg-type]
    assert tracker.failures(99.0) == 3
    decision = tracker.failure(150.0, "boom")  # the failures at 0, 10 and 20 s are outside the window
    assert (decision.event, decision.failures, decision.delay) == (Event.FAILED, 1, 1.0)


def test_restarting_before_the_delay_or_while_running_is_refused() -> None:
    tracker = RestartTracker(POLICY)
    with pytest.raises(ValueError, match="no restart is due"):
        tracker.restarted(0.0)
    tracker.failure(0.0, "boom")
    with pytest.raises(ValueError, match="no restart is due"):
        tracker.restarted(0.5)
    assert tracker.state is State.BACKING_OFF and tracker.restarts == 0


def test_stop_ends_restarts_from_either_live_state() -> None:
    running, backing_off = RestartTracker(POLICY), RestartTracker(POLICY)
    backing_off.failure(0.0, "boom")
    for tracker in (running, backing_off):
        tracker.stop()
        assert tracker.state is State.STOPPED and not tracker.due(1e9) and tracker.retry_after(0.0) is None
        tracker.stop()  # idempotent


def test_zero_tolerated_failures_gives_up_at_once() -> None:
    tracker = RestartTracker(RestartPolicy(max_failures=0))
    assert tracker.failure(0.0, "boom").event is Event.CRASH_LOOP
    assert tracker.state is State.GAVE_UP


class Model:
    """A plain reference: keep every failure time; count those inside the window; delay by the formula."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: list[float] = []
        self.state = "running"
        self.due: float | None = None

    def failure(self, now: float) -> tuple[str, float | None]:
        recent = [t for t in self.times if now - t < self.policy.window] + [now]
        self.times.append(now)
        if len(recent) > self.policy.max_failures:
            self.state, self.due = "gave_up", None
            return "crash_loop", None
        delay = min(self.policy.max_delay, self.policy.base_delay * self.policy.factor ** (len(recent) - 1))
        self.state, self.due = "backing_off", now + delay
        return "failed", delay


@settings(max_examples=300, deadline=None, database=None)
@given(
    policy=st.builds(
        RestartPolicy,
        base_delay=st.floats(0.01, 10),
        max_delay=st.just(60.0),
        factor=st.floats(1.0, 4.0),
        max_failures=st.integers(0, 6),
        window=st.floats(1.0, 500.0),
    ),
    gaps=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=20),
)
def test_the_tracker_matches_a_plain_model(policy: RestartPolicy, gaps: list[float]) -> None:
    tracker, model = RestartTracker(policy), Model(policy)
    now = 0.0
    for gap in gaps:
        if tracker.state is State.GAVE_UP:
            assert model.state == "gave_up"
            break
        decision = tracker.failure(now, "boom")
        event, delay = model.failure(now)
        assert decision.event.value == event and decision.delay == pytest.approx(delay)
        if tracker.state is State.BACKING_OFF:
            assert decision.delay is not None and decision.delay <= policy.max_delay
            assert tracker.due_at == pytest.approx(model.due)
            now = max(now + gap, tracker.due_at)  # type: ignore[type-var]
            assert tracker.due(now)
            tracker.restarted(now)
    assert tracker.restarts == sum(1 for t in model.times) - (1 if model.state == "gave_up" else 0)

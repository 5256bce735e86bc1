"""The relaunch policy of launcher slots: doubling backoff, reset after a healthy run, crash-loop limit."""

from __future__ import annotations

import pytest

from states.relaunch import RelaunchPolicy, SlotRestarts


def test_backoff_doubles_up_to_the_cap() -> None:
    slot = SlotRestarts(RelaunchPolicy(base=0.5, cap=3.0, healthy_after=60.0, window=1000.0, crash_loop_limit=10))
    delays = []
    for now in range(5):
        slot.started(float(now))
        delays.append(slot.ended(now + 0.1, "process exited").delay)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_healthy_run_starts_the_backoff_over() -> None:
    slot = SlotRestarts(RelaunchPolicy(base=1.0, healthy_after=10.0, window=5.0, crash_loop_limit=10))
    slot.started(0.0)
    assert slot.ended(1.0, "x").delay == 1.0
    slot.started(2.0)
    assert slot.ended(3.0, "x").delay == 2.0
    slot.started(4.0)
    assert slot.ended(20.0, "x").delay == 1.0  # it stayed up 16 s


def test_a_crash_loop_gives_up_with_the_count_and_the_last_cause() -> None:
    slot = SlotRestarts(RelaunchPolicy(base=0.1, window=10.0, crash_loop_limit=3))
    decisions = []
    for now in range(4):
        slot.started(float(now))
        decisions.append(slot.ended(now + 0.5, "exit code 1"))
    assert [d.action for d in decisions] == ["restart", "restart", "restart", "give_up"]
    assert decisions[-1].reason == "crash loop: 4 failures within 10 s (last: exit code 1)"
    assert slot.gave_up


def test_failures_outside_the_window_do_not_count() -> None:
    slot = SlotRestarts(RelaunchPolicy(base=0.1, window=10.0, crash_loop_limit=2, healthy_after=1000.0))
    for now in (0.0, 20.0, 40.0, 60.0):
        slot.started(now)
        assert slot.ended(now + 1, "x").action == "restart"


@pytest.mark.parametrize("field", ["base", "cap", "healthy_after", "window", "crash_loop_limit"])
def test_bad_policy_values_are_refused_naming_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RelaunchPolicy(**{field: 0})

"""The supervised-child and process-group rules: pure policy, and the exhaustive explorer over both tables."""

from __future__ import annotations

import pytest

from states import child_process, explore_supervision, process_group, service_child
from states.child_process import Event as ChildEvent
from states.child_process import State as Child
from states.explore import explore


def test_a_stop_escalates_to_sigterm_then_sigkill_and_never_before_its_deadlines():
    due = lambda state, since: child_process.due_signal(state, since_stop=since, stop_timeout=2.0, kill_grace=1.0)  # noqa: E731
    assert due(Child.STOPPING, 1.9) is None
    assert due(Child.STOPPING, 2.1) is ChildEvent.TERMINATE
    assert due(Child.TERMINATED, 2.5) is None
    assert due(Child.TERMINATED, 3.1) is ChildEvent.KILL
    assert due(Child.STOPPING, 3.1) is ChildEvent.KILL  # a late check skips straight to SIGKILL
    assert due(Child.KILLED, 9.0) is None and due(Child.EXITED, 9.0) is None


def test_only_an_unexpected_exit_of_a_serving_group_fails_it():
    on_exit = process_group.on_rank_exit
    assert on_exit(process_group.State.RUNNING, expected=False) is process_group.Event.FAIL
    assert on_exit(process_group.State.RUNNING, expected=True) is None
    for state in (process_group.State.STARTING, process_group.State.CLOSING, process_group.State.FAILED):
        assert on_exit(state, expected=False) is None  # start() reports it, or the exit was asked for, or it already failed


def test_derived_sets_follow_the_tables():
    assert service_child.FAILS_WHEN_LOST == {
        service_child.State.LOADED, service_child.State.STARTING, service_child.State.RUNNING}
    assert service_child.TAKES_CALLS <= service_child.INSIDE_RUNNING
    assert child_process.LIVE == set(child_process.State) - child_process.TERMINAL
    assert process_group.TAKES_CALLS == {process_group.State.RUNNING}


@pytest.mark.parametrize("config", explore_supervision.configurations(small=False), ids=lambda c: c.name)
def test_explorer_finds_no_violation(config):
    report = explore(config)
    assert report.states > 50 and report.violations == ()


def test_explorer_catches_a_group_that_ignores_a_dead_rank(monkeypatch):
    monkeypatch.setattr(process_group, "on_rank_exit", lambda state, *, expected: None)
    (config,) = explore_supervision.configurations(small=True)
    assert any("not running" in v for v in explore(config).violations)


def test_explorer_catches_a_stop_that_never_kills(monkeypatch):
    real = child_process.due_signal
    monkeypatch.setattr(
        child_process, "due_signal",
        lambda state, **kw: None if real(state, **kw) is ChildEvent.KILL else real(state, **kw),
    )
    (config,) = explore_supervision.configurations(small=True)
    assert any("within its bound" in v for v in explore(config).violations)

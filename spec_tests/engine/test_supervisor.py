"""The shared supervisor of child processes: hello, watch, bounded stop, heartbeat deadline, respawn.

Real spawned children (about half a second each); every wait on them is bounded.
The worker group and the process service tests exercise it through its owners.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine.supervisor import ChildExit, ChildSpec, StartupFailed, StartupProblem, Supervisor
from states.child_process import State

from . import supervised_children as children


class Record:
    """What a supervisor told its owner (from its monitor thread)."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, bytes]] = []
        self.exits: list[ChildExit] = []
        self.changed = threading.Condition()

    def on_message(self, index: int, data: bytes) -> None:
        with self.changed:
            self.messages.append((index, data))
            self.changed.notify_all()

    def on_exit(self, exit: ChildExit) -> None:
        with self.changed:
            self.exits.append(exit)
            self.changed.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout), "the supervisor did not report in time"


@pytest.fixture
def made() -> Iterator[list[Supervisor]]:
    supervisors: list[Supervisor] = []
    yield supervisors
    for supervisor in supervisors:
        supervisor.close(timeout=0.0)
    assert multiprocessing.active_children() == []


def supervise(made: list[Supervisor], record: Record, *specs: ChildSpec, **options: Any) -> Supervisor:
    options.setdefault("close_timeout", 2.0)
    options.setdefault("kill_grace", 0.5)
    supervisor = Supervisor(list(specs), on_message=record.on_message, on_exit=record.on_exit, **options)
    made.append(supervisor)
    return supervisor


def test_messages_flow_both_ways_and_a_polite_stop_is_an_expected_exit(made):
    record = Record()
    supervisor = supervise(made, record, ChildSpec("a", children.echo), ChildSpec("b", children.echo))
    hellos: list[tuple[int, bytes]] = []
    supervisor.start(30, check_hello=lambda index, data: hellos.append((index, data)))
    assert sorted(hellos) == [(0, b"hello"), (1, b"hello")]
    assert [supervisor.state(i) for i in (0, 1)] == [State.RUNNING, State.RUNNING]
    assert supervisor.send(1, b"ping")
    record.wait_for(lambda: record.messages == [(1, b"ping")])
    supervisor.close(b"bye")
    assert supervisor.finished and [supervisor.state(i) for i in (0, 1)] == [State.EXITED, State.EXITED]
    assert sorted((e.index, e.exitcode, e.expected, e.cause) for e in record.exits) == [
        (0, 0, True, None), (1, 0, True, None)]
    assert not supervisor.send(0, b"late")  # gone: False, never an exception


def test_a_stop_the_child_ignores_escalates_to_sigterm_then_sigkill_within_its_bound(made):
    record = Record()
    close_timeout, kill_grace = 0.2, 0.3
    supervisor = supervise(made, record, ChildSpec("stubborn", children.stubborn), close_timeout=close_timeout,
                           kill_grace=kill_grace)
    supervisor.start(30)
    began = time.monotonic()
    supervisor.close(b"bye")
    # the stop, SIGTERM and SIGKILL take about the timeout and two kill graces; the failure guarded is a hang (a child
    # never killed): 3 s of slack for a loaded host still tells the two apart
    assert time.monotonic() - began < close_timeout + 2 * kill_grace + 3.0
    (exit,) = record.exits
    assert exit.exitcode == -signal.SIGKILL and exit.expected


def test_an_unexpected_death_is_reported_at_once_as_unexpected(made):
    record = Record()
    supervisor = supervise(made, record, ChildSpec("echo", children.echo))
    supervisor.start(30)
    (pid,) = supervisor.pids
    import os

    os.kill(pid, signal.SIGKILL)
    record.wait_for(lambda: len(record.exits) == 1)
    assert record.exits[0] == ChildExit(0, pid, -signal.SIGKILL, expected=False, cause=None)


def test_a_child_silent_past_its_heartbeat_deadline_is_killed_with_that_cause(made):
    record = Record()
    supervisor = supervise(
        made, record, ChildSpec("beats", children.heartbeat, {"beats": 4, "interval": 0.1}), heartbeat_timeout=0.6,
    )
    supervisor.start(30)
    record.wait_for(lambda: len(record.exits) == 1)
    assert [data for _, data in record.messages] == [b"beat"] * 4  # beating kept it alive
    (exit,) = record.exits
    assert exit.exitcode == -signal.SIGKILL and not exit.expected
    assert exit.cause == "it sent nothing within its heartbeat deadline of 0.6s"


def test_respawn_replaces_a_child_that_died_and_leaves_the_others_alone(made):
    record = Record()
    supervisor = supervise(made, record, ChildSpec("a", children.echo), ChildSpec("b", children.echo))
    supervisor.start(30)
    first_a, b = supervisor.pids
    with pytest.raises(Exception, match="has not exited"):
        supervisor.respawn(0, 30)
    supervisor.kill(0, cause="test")
    record.wait_for(lambda: len(record.exits) == 1)
    assert record.exits[0].cause == "test"
    supervisor.respawn(0, 30)
    new_a, same_b = supervisor.pids
    assert new_a != first_a and same_b == b
    assert supervisor.send(0, b"again")
    record.wait_for(lambda: (0, b"again") in record.messages)


@pytest.mark.parametrize("problem", [StartupProblem.EXITED, StartupProblem.REFUSED, StartupProblem.TIMED_OUT])
def test_a_failed_start_names_the_problem_and_leaves_no_child(made, problem):
    record = Record()
    if problem == StartupProblem.EXITED:
        specs = [ChildSpec("a", children.echo), ChildSpec("b", children.exits_before_hello, {"code": 4})]
        timeout = 30.0
    else:
        specs = [ChildSpec("a", children.echo, {"hello": b"no" if problem == StartupProblem.REFUSED else b"hello"})]
        timeout = 30.0 if problem == StartupProblem.REFUSED else 0.01

    def check(index: int, data: bytes) -> None:
        if data == b"no":
            raise ValueError("bad hello")

    supervisor = supervise(made, record, *specs)
    with pytest.raises(StartupFailed) as caught:
        supervisor.start(timeout, check_hello=check)
    failure = caught.value
    assert failure.problem == problem
    if problem == StartupProblem.EXITED:
        assert failure.index == 1 and failure.exitcode == 4
    if problem == StartupProblem.REFUSED:
        assert isinstance(failure.__cause__, ValueError)
    assert supervisor.finished and multiprocessing.active_children() == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one child"):
        Supervisor([], on_message=lambda i, d: None, on_exit=lambda e: None)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        Supervisor([ChildSpec("a", children.echo)], on_message=lambda i, d: None, on_exit=lambda e: None,
                   heartbeat_timeout=0)

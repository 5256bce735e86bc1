"""Exhaustive exploration of a worker process group over its supervised children.

The world is one group (``states.process_group``) over ``n`` children
(``states.child_process``), driven by the same rules the supervisor and the
group apply: ``due_signal`` for the stop's escalation, ``on_rank_exit`` for what
an exit means to the group. Time is abstract: a stop is *before* its SIGTERM
deadline, *past* it, or *past* the SIGKILL one (``deadline`` moves it on).

Events: ``start``; ``hello(i)`` from a STARTING child; ``refuse(i)`` (its hello
says it could not load, while the group starts); ``start_timeout``; ``exit(i)`` for any live child
at any time (a death, or leaving after its goodbye; a signalled child may also
ignore SIGTERM and only die on SIGKILL, which the liveness check assumes);
``close``; ``deadline``; ``closed`` (the group's ``close`` returns once every
child is reaped).

Invariants checked in every reachable world: a CLOSED group has no live child
(nothing leaks); a RUNNING group's children are all RUNNING; a FAILED group
recorded an unexpected exit, and no expected exit ever failed a group; a child
is signalled only after a stop or a failed start asked for it; a group is
RUNNING only after every child said hello. And BOUNDED STOP: from every world,
``close`` followed by deadlines (children exiting only once SIGKILLed) reaches
CLOSED with every child reaped within a fixed number of steps.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import attrs

from . import child_process, process_group
from .explore import Configuration

__all__ = ["SupervisionWorld", "configurations", "initial_world", "successors", "check", "key"]

Child = child_process.State
Group = process_group.State

STOP_TIMEOUT = 1.0
KILL_GRACE = 1.0
_ELAPSED = (0.0, STOP_TIMEOUT + 0.5, STOP_TIMEOUT + KILL_GRACE + 0.5)  # before SIGTERM, past it, past SIGKILL


@attrs.frozen
class SupervisionWorld:
    group: Group
    children: tuple[Child, ...]
    stop_asked: tuple[bool, ...]  # a stop (or a failed start's kill) was asked for this child
    said_hello: tuple[bool, ...]
    elapsed: int = 0  # index into _ELAPSED since the stop
    start_failing: bool = False
    unexpected_exits: int = 0
    failure_recorded: bool = False
    problems: tuple[str, ...] = ()


def initial_world(n: int) -> SupervisionWorld:
    return SupervisionWorld(Group.NEW, (Child.EXITED,) * n, (False,) * n, (False,) * n)


def _child(state: Child, event: child_process.Event) -> Child:
    machine = child_process.ChildProcessMachine(state)
    return machine.apply(event) if machine.can(event) else state


def _group(state: Group, event: process_group.Event) -> Group:
    return process_group.ProcessGroupMachine(state).apply(event)


def _set(values: tuple, index: int, value: object) -> tuple:
    return (*values[:index], value, *values[index + 1:])


def _fail_start(world: SupervisionWorld) -> SupervisionWorld:
    """A failed start: every live child is killed (the supervisor's rule), and stops are asked for all."""
    children = tuple(_child(state, child_process.Event.KILL) for state in world.children)
    return attrs.evolve(world, children=children, stop_asked=(True,) * len(children), start_failing=True)


def _settle(world: SupervisionWorld) -> SupervisionWorld:
    """What the group does on its own once children changed: ready, or a failed start closed."""
    live = [state for state in world.children if state in child_process.LIVE]
    if world.group is Group.STARTING and world.start_failing and not live:
        return attrs.evolve(world, group=_group(world.group, process_group.Event.START_FAILED))
    if world.group is Group.STARTING and not world.start_failing and all(world.said_hello):
        return attrs.evolve(world, group=_group(world.group, process_group.Event.READY))
    return world


def successors(world: SupervisionWorld) -> Iterable[tuple[str, SupervisionWorld]]:
    n = len(world.children)
    if process_group.ProcessGroupMachine(world.group).can(process_group.Event.START):
        yield "start", attrs.evolve(world, group=_group(world.group, process_group.Event.START),
                                    children=(Child.STARTING,) * n)
    for i, state in enumerate(world.children):
        if state is Child.STARTING and world.group is Group.STARTING and not world.start_failing:
            hello = attrs.evolve(world, children=_set(world.children, i, _child(state, child_process.Event.HELLO)),
                                 said_hello=_set(world.said_hello, i, True))
            yield f"hello({i})", _settle(hello)
            yield f"refuse({i})", _settle(_fail_start(world))
        if state in child_process.LIVE:
            yield f"exit({i})", _exit(world, i)
    if world.group is Group.STARTING and not world.start_failing:
        yield "start_timeout", _settle(_fail_start(world))
    group = process_group.ProcessGroupMachine(world.group)
    if group.can(process_group.Event.CLOSE):
        closed = attrs.evolve(world, group=group.apply(process_group.Event.CLOSE))
        children = tuple(_child(state, child_process.Event.STOP) for state in world.children)
        yield "close", attrs.evolve(closed, children=children, stop_asked=(True,) * n)
    if any(world.stop_asked) and world.elapsed < len(_ELAPSED) - 1:
        yield "deadline", _deadline(world)
    if process_group.ProcessGroupMachine(world.group).can(process_group.Event.CLOSED) and not any(
        state in child_process.LIVE for state in world.children
    ):
        yield "closed", attrs.evolve(world, group=_group(world.group, process_group.Event.CLOSED))


def _exit(world: SupervisionWorld, i: int) -> SupervisionWorld:
    expected = world.stop_asked[i]
    children = _set(world.children, i, _child(world.children[i], child_process.Event.EXIT))
    after = attrs.evolve(world, children=children, unexpected_exits=world.unexpected_exits + (not expected))
    if world.group is Group.STARTING and not world.start_failing:
        return _settle(_fail_start(after))  # a child lost while the group starts fails the start
    reaction = process_group.on_rank_exit(world.group, expected=expected)
    problems = ()
    if reaction is not None:
        if expected:
            problems = ("an expected exit failed the group",)
        after = attrs.evolve(after, group=_group(world.group, reaction), failure_recorded=True)
    return _settle(attrs.evolve(after, problems=problems))


def _deadline(world: SupervisionWorld) -> SupervisionWorld:
    elapsed = world.elapsed + 1
    children = list(world.children)
    for i, state in enumerate(children):
        if not world.stop_asked[i]:
            continue
        due = child_process.due_signal(state, since_stop=_ELAPSED[elapsed], stop_timeout=STOP_TIMEOUT,
                                       kill_grace=KILL_GRACE)
        while due is not None:  # a late check may owe both signals
            children[i] = _child(children[i], due)
            due = child_process.due_signal(children[i], since_stop=_ELAPSED[elapsed], stop_timeout=STOP_TIMEOUT,
                                           kill_grace=KILL_GRACE)
    return attrs.evolve(world, elapsed=elapsed, children=tuple(children), problems=())


def key(world: SupervisionWorld) -> Hashable:
    # children are interchangeable: sort their per-child facts
    per_child = sorted(zip((c.value for c in world.children), world.stop_asked, world.said_hello))
    return (world.group.value, tuple(per_child), world.elapsed, world.start_failing,
            min(world.unexpected_exits, 1), world.failure_recorded)


def check(world: SupervisionWorld) -> list[str]:
    problems = list(world.problems)
    live = [state for state in world.children if state in child_process.LIVE]
    if world.group is Group.CLOSED and live:
        problems.append("a closed group left live children")
    if world.group is Group.RUNNING and any(state is not Child.RUNNING for state in world.children):
        problems.append("a running group has a child that is not running")
    if world.group is Group.RUNNING and not all(world.said_hello):
        problems.append("a group runs before every child said hello")
    if world.group is Group.FAILED and (not world.failure_recorded or not world.unexpected_exits):
        problems.append("a group failed without an unexpected exit")
    for i, state in enumerate(world.children):
        if state in (Child.TERMINATED, Child.KILLED) and not world.stop_asked[i]:
            problems.append(f"child {i} was signalled before a stop asked for it")
    if not _stops_in_bounded_steps(world):
        problems.append("close did not reap every child and close the group within its bound")
    return problems


def _stops_in_bounded_steps(world: SupervisionWorld) -> bool:
    """Close (if it can), then deadlines; children exit only once SIGKILLed (the worst case)."""
    for _ in range(len(_ELAPSED) + 3):
        if world.group is Group.CLOSED:
            return not any(state in child_process.LIVE for state in world.children)
        moves = dict(successors(world))
        killed = [i for i, state in enumerate(world.children) if state is Child.KILLED]
        if killed:
            for i in killed:
                world = _exit(world, i)
        elif "close" in moves:
            world = moves["close"]
        elif "closed" in moves:
            world = moves["closed"]
        elif "deadline" in moves:
            world = moves["deadline"]
        elif "start_timeout" in moves:  # close waits for a start, which its timeout bounds
            world = moves["start_timeout"]
        else:
            return False
    return world.group is Group.CLOSED and not any(state in child_process.LIVE for state in world.children)


def configurations(small: bool) -> list[Configuration]:
    sizes = (2,) if small else (2, 3)
    return [
        Configuration(
            name=f"supervision: {n} children",
            initial=lambda n=n: initial_world(n),
            successors=successors,
            key=key,
            check=check,
        )
        for n in sizes
    ]

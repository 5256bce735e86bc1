"""Exhaustive exploration of the room-follow book (``states.room_follow``).

The world is the book of ``sessions`` sessions on one transport kind (its start
event: WATCH, LOOK_INTO or LEAVE_TO_WORKER), beside the definitions of what
happened to each session: started, handed over (its worker said who is in the
room), stopped, and how many of the runtime's looks into its room are under way
(the poll's and a token request's may overlap: at most ``LOOKS`` at once).
Events, in any interleaving: a session starts (in index order: sessions differ
only in when they were created, which orders the poll); a look begins (only where the
book says the room is looked into, as the server does) and later its result
arrives; a token is asked for (its check lists the room, or not); the worker
hands over (again and again, as an agent's reports do, and late, after the stop);
the session stops (twice: stop is idempotent).

Invariants checked in every reachable world, against the definitions: a look's
result is taken exactly while the room is looked into, so never after a
hand-over or a stop; a token's check lists the room exactly where it can be listed
(LiveKit) and the session has not stopped, handed over or not; the followed rooms are those watched, or looked into and
not handed over, of sessions not stopped; a stop clears the record's count
exactly where it was the runtime's to keep, and only the first stop; every
session the book holds can still stop, and none it holds has ended (ENDED is
terminal: the ended machine leaves the book, and nothing brings it back).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable

import attrs

from .explore import Configuration
from .room_follow import STARTS, Event, RoomFollowBook, State

__all__ = ["FollowWorld", "LOOKS", "configurations", "successors", "check", "key"]

LOOKS = 2  # looks into one room under way at once, at most (the poll's, a token request's)


@attrs.frozen
class Session:
    """The definitions for one session: what happened to it, whatever the book says."""

    started: bool = False
    handed_over: bool = False
    stopped: bool = False
    looks: int = 0  # looks into its room under way


@attrs.frozen
class FollowWorld:
    book: RoomFollowBook = attrs.field(eq=False)
    sessions: tuple[Session, ...]
    problems: tuple[str, ...] = ()


def initial_world(start_with: Event, sessions: int) -> FollowWorld:
    return FollowWorld(RoomFollowBook(start_with), (Session(),) * sessions)


def runtime_keeps(start_with: Event, session: Session) -> bool:
    """The definition: the runtime keeps the count where it watches the room, or looks into it until the hand-over."""
    if not session.started or session.stopped:
        return False
    return start_with is Event.WATCH or (start_with is Event.LOOK_INTO and not session.handed_over)


def looked_into(start_with: Event, session: Session) -> bool:
    return start_with is Event.LOOK_INTO and runtime_keeps(start_with, session)


def token_checks(start_with: Event, session: Session) -> bool:
    """The definition: a token's check lists the room wherever rooms are listed (LiveKit), from the session's
    creation to its stop, whoever keeps the count (the worker's word comes a moment after a join returns)."""
    return start_with is Event.LOOK_INTO and session.started and not session.stopped


def successors(world: FollowWorld) -> Iterable[tuple[str, FollowWorld]]:
    start_with = world.book.start_with
    for index, session in enumerate(world.sessions):

        def after(label: str, book: RoomFollowBook, problems: tuple[str, ...] = (), **changes: object):
            sessions = list(world.sessions)
            sessions[index] = attrs.evolve(session, **changes)  # type: ignore[arg-type]
            return f"s{index} {label}", FollowWorld(book, tuple(sessions), problems)

        if not session.started:  # in index order: sessions are alike but for when they were created
            if all(earlier.started for earlier in world.sessions[:index]):
                book = copy.deepcopy(world.book)
                book.start(index)
                yield after("starts", book, started=True)
            continue
        if session.looks < LOOKS and world.book.looks_into(index):
            yield after("look begins", copy.deepcopy(world.book), looks=session.looks + 1)
        if session.looks:
            book = copy.deepcopy(world.book)
            taken = book.take_look(index)
            expected = looked_into(start_with, session)
            problems = () if taken is expected else (f"s{index}: a look's result taken {taken}, expected {expected}",)
            yield after("look arrives", book, problems, looks=session.looks - 1)
        book = copy.deepcopy(world.book)
        checked = book.check(index)
        expected = token_checks(start_with, session)
        problems = () if checked is expected else (f"s{index}: a token's check listed {checked}, expected {expected}",)
        yield after("token asked", book, problems)
        book = copy.deepcopy(world.book)
        book.hand_over(index)
        yield after("hand-over", book, handed_over=not session.stopped or session.handed_over)
        book = copy.deepcopy(world.book)
        cleared = book.stop(index)
        expected = runtime_keeps(start_with, session)
        problems = () if cleared is expected else (f"s{index}: a stop cleared the count {cleared}, expected {expected}",)
        yield after("stops", book, problems, stopped=True)


def check(world: FollowWorld) -> list[str]:
    problems = list(world.problems)
    book, start_with = world.book, world.book.start_with
    expected = frozenset(i for i, session in enumerate(world.sessions) if runtime_keeps(start_with, session))
    if book.followed() != expected:
        problems.append(f"followed {sorted(book.followed())}, the definitions give {sorted(expected)}")
    looked = [i for i, session in enumerate(world.sessions) if looked_into(start_with, session)]
    if book.looked_into() != looked:
        problems.append(f"looked into {book.looked_into()}, the definitions give {looked}")
    for index, session in enumerate(world.sessions):
        state = book.state(index)
        held = session.started and not session.stopped
        if (state is not None) != held:
            problems.append(f"s{index}: the book {'holds' if state is not None else 'lacks'} it in {state}")
        if state is State.ENDED or state is State.NEW:
            problems.append(f"s{index}: the book holds it in {state.name}")
        if state is not None and not book.machines[index].can(Event.STOP):
            problems.append(f"s{index}: it cannot stop from {state.name}")
    return problems


def key(world: FollowWorld) -> Hashable:
    """The book's order is kept: the poll looks into the rooms in the order the sessions were created."""
    states = tuple(world.book.state(i) for i in range(len(world.sessions)))
    return world.sessions, states, tuple(world.book.machines), world.problems


def configurations(small: bool) -> list[Configuration[FollowWorld]]:
    sessions = 2 if small else 3
    return [
        Configuration(
            name=f"room follow: start {start_with.name}, {sessions} sessions, {LOOKS} looks each",
            initial=lambda start_with=start_with: initial_world(start_with, sessions),
            successors=successors,
            key=key,
            check=check,
        )
        for start_with in sorted(STARTS, key=lambda event: event.value)
    ]

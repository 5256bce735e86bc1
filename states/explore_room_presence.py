"""Exhaustive exploration of one room's presence book (``states.room_presence``).

The world is the book of one room (its controller and ``viewers`` others) on a
whole-second clock up to ``horizon``. Events: the controller or a viewer joins
or leaves; ``tick`` moves the clock one second on and asks the book whether a
deadline has passed (``due``), as the room runner does when its timer fires.

Invariants checked in every reachable world, against the definitions (not the
book's own bookkeeping): a timer runs for the controller exactly while it is
not here, from the start for one that never came and from its departure for
one that left; the room-empty timer runs exactly while nobody is here after
the controller had come; the deadline is the earliest of those (the
controller's on a tie); the watch ends only when that deadline has passed,
never while the controller is here, and with the cause of the timer that
passed. And two that hold whatever the definitions say: a controller that never
came is waited for until its own deadline and the end says ``controller_absent``;
others never bring the end before the controller's own deadline (the one its
joins and departures alone would give: the controller timeout from the start,
or the earlier of the two timeouts from its departure). A room-empty timer that
ran before the controller came broke both: a viewer who joined and left ended
the session at 30 s of the controller's 60 as ``room_empty``.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable

import attrs

from .explore import Configuration
from .room_presence import RoomPresence, State, Timer

__all__ = ["PresenceWorld", "configurations", "successors", "check", "key"]

CONTROLLER = "ctl"


@attrs.frozen
class PresenceWorld:
    book: RoomPresence = attrs.field(eq=False)
    now: int
    # the definitions, kept beside the book
    here: frozenset[str]
    controller_came: bool
    controller_left_at: int | None
    emptied_at: int | None  # when the room last became empty
    ended_by: Timer | None
    problems: tuple[str, ...] = ()


def initial_world(controller_timeout: int, room_empty_timeout: int) -> PresenceWorld:
    book = RoomPresence(CONTROLLER, float(controller_timeout), float(room_empty_timeout), 0.0)
    return PresenceWorld(book, 0, frozenset(), False, None, None, None)


def expected_deadline(world: PresenceWorld) -> tuple[float, Timer] | None:
    if world.ended_by is not None:
        return None
    book = world.book
    due: list[tuple[float, int, Timer]] = []
    if CONTROLLER not in world.here:
        if world.controller_came:
            assert world.controller_left_at is not None
            due.append((world.controller_left_at + book.controller_timeout, 0, Timer.CONTROLLER_LEFT))
        else:
            due.append((book.controller_timeout, 0, Timer.CONTROLLER_ABSENT))
    if not world.here and world.controller_came:
        assert world.emptied_at is not None
        due.append((world.emptied_at + book.room_empty_timeout, 1, Timer.ROOM_EMPTY))
    if not due:
        return None
    at, _, timer = min(due)
    return at, timer


def successors(world: PresenceWorld, viewers: int, horizon: int) -> Iterable[tuple[str, PresenceWorld]]:
    if world.ended_by is not None:
        return
    for who in (CONTROLLER, *(f"viewer-{i}" for i in range(viewers))):
        book = copy.deepcopy(world.book)
        if who in world.here:
            book.left(who, float(world.now))
            here = world.here - {who}
            yield f"{who} leaves", attrs.evolve(
                world,
                book=book,
                here=here,
                controller_left_at=world.now if who == CONTROLLER else world.controller_left_at,
                emptied_at=world.now if not here else world.emptied_at,
            )
        else:
            book.joined(who, float(world.now))
            yield f"{who} joins", attrs.evolve(
                world,
                book=book,
                here=world.here | {who},
                controller_came=world.controller_came or who == CONTROLLER,
                emptied_at=None,
            )
    if world.now < horizon:
        book = copy.deepcopy(world.book)
        now = world.now + 1
        ended = book.due(float(now))
        expected = expected_deadline(world)
        should_end = expected[1] if expected is not None and expected[0] <= now else None
        problems = () if ended is should_end else (f"at {now} s the book ended by {ended}, the definitions by {should_end}",)
        yield "tick", attrs.evolve(world, book=book, now=now, ended_by=ended, problems=problems)


def controllers_own_deadline(world: PresenceWorld) -> float | None:
    """The end the controller's joins and departures alone would give (None while it is here): others may put it
    off, never bring it nearer."""
    book = world.book
    if not world.controller_came:
        return book.controller_timeout
    if CONTROLLER in world.here:
        return None
    assert world.controller_left_at is not None
    return world.controller_left_at + min(book.controller_timeout, book.room_empty_timeout)


def others_never_hasten_the_end(world: PresenceWorld) -> list[str]:
    """Whatever the definitions say: a controller that never came is waited for until its deadline, and ends
    the watch as absent; nobody else's joins and departures bring the end before the controller's own."""
    book, problems = world.book, []
    own = controllers_own_deadline(world)
    if world.ended_by is not None:
        if not world.controller_came and world.ended_by is not Timer.CONTROLLER_ABSENT:
            problems.append(f"the controller never came, and the watch ended by {world.ended_by.value}")
        if own is not None and world.now < own:
            problems.append(f"the watch ended at {world.now} s, before the controller's own deadline ({own:g} s)")
    elif own is not None and (nearest := book.deadline()) is not None and nearest[0] < own:
        problems.append(f"the next deadline {nearest[0]:g} s ({nearest[1].value}) comes before the controller's own "
                        f"({own:g} s)")
    return problems


def check(world: PresenceWorld) -> list[str]:
    problems = list(world.problems) + others_never_hasten_the_end(world)
    book = world.book
    expected = expected_deadline(world)
    if world.ended_by is None and book.deadline() != expected:
        problems.append(f"deadline {book.deadline()} but the definitions give {expected}")
    if world.ended_by is not None:
        if book.state is not State.ENDED or book.ended_by is not world.ended_by:
            problems.append(f"ended by {world.ended_by} but the book is {book.state} ({book.ended_by})")
        if CONTROLLER in world.here:
            problems.append("the watch ended while the controller was here")
    elif book.state is State.ENDED:
        problems.append("the book ended with no timer due")
    if (book.state is State.PRESENT) != (CONTROLLER in world.here and world.ended_by is None):
        problems.append(f"state {book.state.name} with the controller {'here' if CONTROLLER in world.here else 'away'}")
    return problems


def key(world: PresenceWorld) -> Hashable:
    """Viewers are interchangeable: only how many are here matters."""
    viewers_here = len(world.here - {CONTROLLER})
    return (
        world.now, CONTROLLER in world.here, viewers_here, world.controller_came,
        world.controller_left_at, world.emptied_at, world.ended_by, world.book.state,
    )


def ended_by_each_timer(world_count_limit: int = 100_000) -> set[Timer]:
    """Which timers can end the watch (each must be reachable): a helper for the tests."""
    ends: set[Timer] = set()
    for controller_timeout, room_empty_timeout in ((3, 2), (2, 3)):
        seen: set[Hashable] = set()
        frontier = [initial_world(controller_timeout, room_empty_timeout)]
        while frontier and len(seen) < world_count_limit:
            world = frontier.pop()
            if key(world) in seen:
                continue
            seen.add(key(world))
            if world.ended_by is not None:
                ends.add(world.ended_by)
            frontier.extend(w for _, w in successors(world, 1, 6))
    return ends


def configurations(small: bool) -> list[Configuration[PresenceWorld]]:
    shapes = ((3, 2, 1, 6), (2, 3, 1, 6)) if small else ((3, 2, 2, 8), (2, 3, 2, 8), (4, 4, 3, 10))
    return [
        Configuration(
            name=f"room presence: controller {ct} s, room empty {et} s, {viewers} viewer(s), {horizon} s",
            initial=lambda ct=ct, et=et: initial_world(ct, et),
            successors=lambda world, viewers=viewers, horizon=horizon: successors(world, viewers, horizon),
            key=key,
            check=check,
        )
        for ct, et, viewers, horizon in shapes
    ]

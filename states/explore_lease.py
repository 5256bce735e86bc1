"""Exhaustive exploration of the execution-lease book (``states.lease_book``).

The world is a :class:`LeaseBook` with every session registered at time 0,
the current time, and what the explorer itself remembers (independently of
the book's own flags) to judge each step: the FIFO order it expects, which
sessions queued behind an occupied lease (and so are owed one chunk once
granted), and the violations seen on the step that produced the world.

Events: ``activity(s)`` for every known session; ``idle(s)`` (its driver has
nothing to run) and ``want(s)`` (its driver has a chunk to run: ``request_turn``); ``begin(s)`` for the holder
between chunks; ``relinquish(s)`` for the holder between chunks (its driver
has nothing to run); ``finish(s)`` / ``abort(s)`` for a session mid-chunk; ``tick``
(time jumps by exactly ``idle_timeout`` -- so every stamp is stale -- then the
periodic ``tick``); ``close(s)``; ``release(s)`` after close once its chunk is
over. Time only moves in whole idle timeouts, so a stamp is either fresh (made
at the current time) or expired, and ``LeaseBook.canonical_key`` makes the
space finite.

Invariants checked in every reachable world: at most one ACTIVE holder and at
most one chunk in flight, and never both an ACTIVE holder and a closing
session's chunk; the lease never changes hands (no GRANT, no PARK) while a
chunk is in flight except at that chunk's own boundary; a RELINQUISH comes
only from the holder between chunks, as the holder's own call, and leaves it
PARKED and out of the FIFO; every other park (the book's own decision) only
takes an idle-expired holder, only when someone waits, and never before a
session's guaranteed chunk; a grant goes to the FIFO head, which queued
through activity; a parked (idle-parked or relinquished) session is never
granted without new activity of its own -- the explorer tracks the parked
sessions independently and checks they are exactly the book's PARKED ones; a
session that queued behind an occupied lease runs one chunk before the book
parks it; a waiting or parked session is queued only by a new control (its own
``activity``, or its driver's ``want`` after a control it had not used); an
idle-declared holder never holds the lease between chunks while someone waits,
and the book relinquishes for it only between chunks and only for a waiter;
closed sessions are neither ACTIVE nor queued; queue positions are 1..n in
FIFO order; a free lease with waiters never persists; the returned
transitions are exactly the state changes; and NO STARVATION: from every
world, the schedule "holder runs a chunk, then an idle tick" repeated
``3 * (n + 1)`` times grants every session queued now.

Configurations with rotation (``LeaseBook(..., rotate=True)``) check, besides
all of the above: a holder leaves the lease at its own chunk boundary whenever
someone waits (PARKED if idle-expired, else YIELDed to the FIFO tail); a yield
(ACTIVE -> QUEUED) happens only with rotation on, only at the yielding
holder's own ``finish``, only when someone waits and only for a non-idle
holder; and ROUND ROBIN: from every
world, with every live session sending activity before each chunk and the
holder (or a draining chunk) running chunks, every session queued now is
granted within (number queued + 1) chunk boundaries.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import attrs

from .explore import Configuration
from .lease import State
from .lease_book import LeaseBook, LeaseTransition

__all__ = ["LeaseWorld", "configurations", "initial_world", "successors", "check", "key"]

IDLE_TIMEOUT = 1.0


@attrs.frozen
class LeaseWorld:
    book: LeaseBook = attrs.field(eq=False)
    now: float
    expected_fifo: tuple[str, ...] = ()
    owed_chunk: frozenset[str] = frozenset()  # queued behind an occupied lease, not yet run
    parked: frozenset[str] = frozenset()  # parked or relinquished, not queued since
    idle: frozenset[str] = frozenset()  # drivers that declared they have nothing to run
    fresh: frozenset[str] = frozenset()  # a control came since the session last queued, parked or relinquished
    problems: tuple[str, ...] = ()


def initial_world(session_ids: Sequence[str], *, rotate: bool = False) -> LeaseWorld:
    book = LeaseBook(IDLE_TIMEOUT, rotate=rotate)
    for session_id in session_ids:
        book.register(session_id, 0.0)
    return LeaseWorld(book=book, now=0.0)


def key(world: LeaseWorld) -> Hashable:
    return (
        world.book.canonical_key(world.now),
        world.expected_fifo,
        world.owed_chunk,
        world.parked,
        world.idle,
        world.fresh,
        world.problems,
    )


def _states(book: LeaseBook) -> dict[str, State]:
    return {snap.session_id: snap.state for snap in book.snapshot()}


def _busy(book: LeaseBook) -> tuple[str, ...]:
    return tuple(snap.session_id for snap in book.snapshot() if snap.busy)


def _step(world: LeaseWorld, label: str, kind: str, session_id: str | None) -> LeaseWorld:
    """Apply one event to a copy of the world and judge the step."""
    book = world.book.clone()
    now = world.now
    before = _states(book)
    busy_before = _busy(book)
    occupant_before = book.holder() or book.draining()
    holder_before = book.holder()
    fifo = list(world.expected_fifo)
    owed = set(world.owed_chunk)
    parked = set(world.parked)
    idle = set(world.idle)
    fresh = set(world.fresh)
    problems: list[str] = []

    def queues(sid: str) -> None:
        fifo.append(sid)
        if occupant_before is not None:
            owed.add(sid)
        else:
            owed.discard(sid)
        parked.discard(sid)
        fresh.discard(sid)

    may_queue: str | None = None  # the one session this step may move from WAITING/PARKED to QUEUED
    if kind == "activity":
        assert session_id is not None
        fresh.add(session_id)
        if before[session_id] in (State.WAITING, State.PARKED) and session_id not in idle:
            queues(session_id)
            may_queue = session_id
        transitions = book.record_activity(session_id, now)
    elif kind == "want":
        assert session_id is not None
        idle.discard(session_id)
        if before[session_id] in (State.WAITING, State.PARKED) and session_id in fresh:
            queues(session_id)
            may_queue = session_id
        transitions = book.request_turn(session_id, now)
    elif kind == "idle":
        assert session_id is not None
        idle.add(session_id)
        transitions = book.declare_idle(session_id)
    elif kind == "begin":
        assert session_id is not None
        transitions = book.begin_chunk(session_id)
        owed.discard(session_id)
    elif kind == "relinquish":
        assert session_id is not None
        if session_id != holder_before or session_id in busy_before:
            problems.append(f"{label} by a session that is not the holder between chunks")
        transitions = book.relinquish(session_id, now)
        owed.discard(session_id)
    elif kind == "finish":
        assert session_id is not None
        transitions = book.finish_chunk(session_id, now)
    elif kind == "abort":
        assert session_id is not None
        transitions = book.abort_chunk(session_id)
    elif kind == "tick":
        now = now + IDLE_TIMEOUT
        transitions = book.tick(now)
    elif kind == "close":
        assert session_id is not None
        transitions = book.close(session_id)
        owed.discard(session_id)
        parked.discard(session_id)
        idle.discard(session_id)
        fresh.discard(session_id)
    elif kind == "release":
        assert session_id is not None
        transitions = book.release(session_id)
    else:  # pragma: no cover - the successor list names every kind
        raise AssertionError(kind)

    after = _states(book)
    # the returned transitions are exactly the state changes
    changed = {sid for sid in before if after.get(sid, before[sid]) is not before[sid]}
    reported: dict[str, State] = {}
    for transition in transitions:
        if not isinstance(transition, LeaseTransition):
            problems.append(f"non-transition {transition!r} returned by {label}")
            continue
        reported[transition.session_id] = transition.state
    # (a session may be reported more than once in a step and end where it started: a yield, then a
    # grant after an idle-declared holder stepped aside)
    if not changed <= set(reported) or any(after.get(sid, state) is not state for sid, state in reported.items()):
        problems.append(f"{label} reported {reported} but changed {sorted(changed)}")

    chunk_boundary = kind in ("finish", "abort") and session_id in busy_before
    relinquished = False
    current = dict(before)  # each session's state just before the transition being judged
    for transition in transitions:
        sid, state = transition.session_id, transition.state
        was, current[sid] = current.get(sid), state
        if state is State.ACTIVE:
            if busy_before and not chunk_boundary:
                problems.append(f"{sid} granted mid-chunk of {busy_before[0]} by {label}")
            if not fifo or fifo[0] != sid:
                problems.append(f"{sid} granted out of FIFO order {fifo} by {label}")
            else:
                fifo.pop(0)
            fresh_activity = kind in ("activity", "want") and sid == may_queue
            if was is not State.QUEUED and not fresh_activity:
                problems.append(f"{sid} granted from {was.name if was else None} without new activity")
            if sid in parked:
                problems.append(f"parked {sid} granted without new activity by {label}")
        elif state is State.QUEUED and was is State.ACTIVE:  # a yield
            if not book.rotate:
                problems.append(f"{sid} yielded by {label} without rotation")
            if not (kind == "finish" and sid == session_id):
                problems.append(f"{sid} yielded outside its own chunk boundary by {label}")
            if not fifo:
                problems.append(f"{sid} yielded with nobody waiting by {label}")
            if world.book.is_idle_expired(sid, now):
                problems.append(f"idle {sid} yielded (re-queued) instead of parked by {label}")
            fifo.append(sid)
        elif state is State.QUEUED and was in (State.WAITING, State.PARKED):
            if sid != may_queue:
                problems.append(f"{sid} queued from {was.name} without a new control by {label}")
        elif state is State.PARKED and sid in idle and was is State.ACTIVE and not (
            kind == "relinquish" and sid == session_id and not relinquished
        ):
            # the book relinquishes for an idle-declared holder: only between chunks, only for a waiter
            parked.add(sid)
            fresh.discard(sid)
            owed.discard(sid)  # stepping aside forfeits a guaranteed chunk
            if sid in _busy(book) or (sid in busy_before and not (chunk_boundary and sid == session_id)):
                problems.append(f"idle-declared {sid} relinquished mid-chunk by {label}")
            if not fifo:
                problems.append(f"idle-declared {sid} relinquished with nobody waiting by {label}")
        elif state is State.PARKED and kind == "relinquish" and sid == session_id and not relinquished:
            # the holder's own call: neither idleness nor waiters are needed
            relinquished = True
            parked.add(sid)
            fresh.discard(sid)
            if was is not State.ACTIVE:
                problems.append(f"{sid} relinquished from {was.name if was else None}")
            if transition is not transitions[0]:
                problems.append(f"{label} did not park the holder first: {transitions}")
        elif state is State.PARKED:
            parked.add(sid)
            fresh.discard(sid)
            if not book.is_idle_expired(sid, now):
                problems.append(f"{sid} parked while not idle by {label}")
            if sid in busy_before and not (chunk_boundary and sid == session_id):
                problems.append(f"{sid} parked mid-chunk by {label}")
            if busy_before and not chunk_boundary:
                problems.append(f"{sid} parked while a chunk of {busy_before[0]} runs ({label})")
            if not fifo:
                problems.append(f"{sid} parked with nobody waiting by {label}")
            if sid in owed:
                problems.append(f"{sid} parked before its guaranteed chunk by {label}")
        elif state is State.CLOSING and sid in fifo:
            fifo.remove(sid)
    if kind == "relinquish" and not relinquished:
        problems.append(f"{label} did not park the holder: {transitions}")
    if (
        book.rotate
        and kind == "finish"
        and session_id == holder_before
        and any(waiter not in world.idle for waiter in world.expected_fifo)  # idle-declared waiters step aside
        and after.get(session_id) is State.ACTIVE
    ):
        problems.append(f"{session_id} kept the lease at its chunk boundary while {world.expected_fifo} waited")
    return LeaseWorld(
        book=book,
        now=now,
        expected_fifo=tuple(fifo),
        owed_chunk=frozenset(owed) & frozenset(after),
        parked=frozenset(parked) & frozenset(after),
        idle=frozenset(idle) & frozenset(after),
        fresh=frozenset(fresh) & frozenset(after),
        problems=tuple(problems),
    )


def successors(world: LeaseWorld) -> Iterable[tuple[str, LeaseWorld]]:
    book = world.book
    states = _states(book)
    holder = book.holder()
    busy = _busy(book)
    for sid, state in states.items():
        yield f"activity({sid})", _step(world, f"activity({sid})", "activity", sid)
        if state is not State.CLOSING and sid not in world.idle:
            yield f"idle({sid})", _step(world, f"idle({sid})", "idle", sid)
        if state is not State.CLOSING and (sid in world.idle or state in (State.WAITING, State.PARKED)):
            yield f"want({sid})", _step(world, f"want({sid})", "want", sid)
    if holder is not None and not book.is_busy(holder):
        yield f"begin({holder})", _step(world, f"begin({holder})", "begin", holder)
        yield f"relinquish({holder})", _step(world, f"relinquish({holder})", "relinquish", holder)
    for sid in busy:
        yield f"finish({sid})", _step(world, f"finish({sid})", "finish", sid)
        yield f"abort({sid})", _step(world, f"abort({sid})", "abort", sid)
    yield "tick", _step(world, "tick", "tick", None)
    for sid, state in states.items():
        if state is not State.CLOSING:
            yield f"close({sid})", _step(world, f"close({sid})", "close", sid)
        elif sid not in busy:
            yield f"release({sid})", _step(world, f"release({sid})", "release", sid)


def _starves(world: LeaseWorld) -> list[str]:
    """Simulate holder chunks and idle ticks on a copy; every queued session must be granted."""
    book = world.book.clone()
    now = world.now
    waiting = set(book.queued())
    rounds = 3 * (len(book) + 1)
    for _ in range(rounds):
        if not waiting:
            return []
        transitions: list[LeaseTransition] = []
        for sid in _busy(book):
            transitions += book.finish_chunk(sid, now)
        holder = book.holder()
        if holder is not None:
            transitions += book.begin_chunk(holder)
            transitions += book.finish_chunk(holder, now)
        now += IDLE_TIMEOUT
        transitions += book.tick(now)
        waiting -= {t.session_id for t in transitions if t.state is State.ACTIVE}
    return [f"starvation: {sorted(waiting)} never granted within {rounds} rounds"] if waiting else []


def _round_robin_violations(world: LeaseWorld) -> list[str]:
    """Rotation liveness: every live session sends activity before each chunk and
    the lease runs chunks; each session queued now must be granted within
    (number queued + 1) chunk boundaries."""
    book = world.book.clone()
    now = world.now
    waiting = set(book.queued())
    limit = len(waiting) + 1
    boundaries = 0
    while waiting:
        transitions: list[LeaseTransition] = []
        for snap in book.snapshot():
            if snap.state is not State.CLOSING:
                transitions += book.record_activity(snap.session_id, now)
        waiting -= {t.session_id for t in transitions if t.state is State.ACTIVE}
        if not waiting:
            break
        if boundaries == limit:
            return [
                f"round robin: {sorted(waiting)} not granted within {limit} chunk boundaries"
                f" of continuous activity"
            ]
        busy = _busy(book)
        holder = book.holder()
        if busy:
            transitions = book.finish_chunk(busy[0], now)
        elif holder is not None:
            transitions = book.begin_chunk(holder) + book.finish_chunk(holder, now)
        else:
            return [f"round robin: {sorted(waiting)} wait but nobody holds the lease"]
        boundaries += 1
        waiting -= {t.session_id for t in transitions if t.state is State.ACTIVE}
    return []


def check(world: LeaseWorld) -> Sequence[str]:
    book = world.book
    problems = list(world.problems)
    snaps = book.snapshot()
    active = [s.session_id for s in snaps if s.state is State.ACTIVE]
    busy = [s.session_id for s in snaps if s.busy]
    if len(active) > 1:
        problems.append(f"two holders {active}")
    if len(busy) > 1:
        problems.append(f"two chunks in flight {busy}")
    draining = book.draining()
    if active and draining is not None:
        problems.append(f"{active[0]} holds the lease while {draining}'s chunk runs")
    for snap in snaps:
        if snap.busy and snap.state not in (State.ACTIVE, State.CLOSING):
            problems.append(f"{snap.session_id} busy while {snap.state.name}")
        if snap.state is State.CLOSING and snap.queue_position is not None:
            problems.append(f"closed {snap.session_id} still queued")
        if (snap.state is State.QUEUED) != (snap.queue_position is not None):
            problems.append(f"{snap.session_id} {snap.state.name} at position {snap.queue_position}")
    queued = book.queued()
    positions = [book.queue_position(sid) for sid in queued]
    if positions != list(range(1, len(queued) + 1)):
        problems.append(f"queue positions {positions} are not 1..n")
    if queued != world.expected_fifo:
        problems.append(f"FIFO {queued} but arrivals order {world.expected_fifo}")
    if queued and book.lease_free():
        problems.append(f"lease free while {queued} wait")
    book_parked = {snap.session_id for snap in snaps if snap.state is State.PARKED}
    if book_parked != world.parked:
        problems.append(f"PARKED {sorted(book_parked)} but parked and not queued since {sorted(world.parked)}")
    holder = book.holder()
    if holder is not None and holder in world.idle and not book.is_busy(holder) and queued:
        problems.append(f"idle-declared {holder} holds the lease between chunks while {queued} wait")
    for snap in snaps:
        if snap.state is not State.CLOSING and (
            book.is_idle_declared(snap.session_id) != (snap.session_id in world.idle)
            or book.has_fresh_activity(snap.session_id) != (snap.session_id in world.fresh)
        ):
            problems.append(f"{snap.session_id}: the book's idle/fresh marks differ from the driver's")
    problems += _starves(world)
    if book.rotate:
        problems += _round_robin_violations(world)
    return problems


def _configuration(sessions: tuple[str, ...], *, rotate: bool = False) -> Configuration:
    return Configuration(
        name=f"lease book {len(sessions)} sessions{', rotate' if rotate else ''}",
        initial=lambda: initial_world(sessions, rotate=rotate),
        successors=successors,
        key=key,
        check=check,
    )


def configurations(small: bool) -> list[Configuration]:
    """Small: 2 sessions, without and with rotation. Full: 3 sessions, without and with rotation
    (with the drivers' idle and want events, 4 sessions is past a minute-scale budget)."""
    if small:
        return [_configuration(("a", "b")), _configuration(("a", "b"), rotate=True)]
    return [
        _configuration(("a", "b", "c")),
        _configuration(("a", "b", "c"), rotate=True),
    ]

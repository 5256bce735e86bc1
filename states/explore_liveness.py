"""Exhaustive configurations of the liveness book for ``python -m states.explore``.

A world is the book, the authority's clock (whole seconds) and how many agents
have registered. Agents register in id order (they are interchangeable). Events:
register the next agent; for each registered id, a message heard from it, READY,
DRAIN, LEAVE and LOSE ("socket closed"); and a tick, which advances the clock
one second and runs :meth:`~states.liveness.LivenessBook.expire`, as the
authority's sweeper does.

Rules judged on each step (recorded as notes): a terminal id never comes back;
a message from a terminal id is refused and counted; expiry loses exactly the
workers whose deadline passed, with a cause; a live worker is never past its
deadline after a tick; an agent's fence comes before the authority's deadline.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import attrs

from .explore import Configuration
from .liveness import TERMINAL, LivenessBook, State, fence_at

__all__ = ["configurations", "World"]


@attrs.frozen
class World:
    book: LivenessBook  # never mutated once built: successors work on a copy
    agents: int  # how many may register
    horizon: int  # the clock stops here
    now: int = 0
    registered: int = 0
    notes: tuple[str, ...] = ()

    def key(self) -> Hashable:
        return (self.book.canonical_key(self.now), self.registered, self.now >= self.horizon, self.notes)


def wid(index: int) -> str:
    return f"w{index}"


def _step_notes(before: LivenessBook, after: LivenessBook, label: str) -> list[str]:
    notes = []
    for view in before.views():
        now_state = after.state(view.worker_id)
        if view.state in TERMINAL and now_state is not None and now_state is not view.state:
            notes.append(f"{label}: terminal {view.worker_id} moved {view.state.name} -> {now_state.name}")
    return notes


def _successors(world: World) -> Iterator[tuple[str, World]]:
    book = world.book
    now = float(world.now)

    def step(label: str, nxt: LivenessBook, notes: list[str], **changes: object) -> tuple[str, World]:
        notes = notes + _step_notes(book, nxt, label)
        return label, attrs.evolve(world, book=nxt, notes=(*world.notes, *notes), **changes)  # type: ignore[arg-type]

    if world.registered < world.agents:
        nxt = book.copy()
        nxt.register(wid(world.registered), now)
        yield step(f"register {wid(world.registered)}", nxt, [], registered=world.registered + 1)

    for index in range(world.registered):
        w = wid(index)
        state = book.state(w)
        nxt = book.copy()
        accepted = nxt.heard(w, now)
        notes = []
        if state is None or state in TERMINAL:
            if accepted or nxt.stale_dropped != book.stale_dropped + 1:
                notes.append(f"stale message from {w} ({state}) accepted or not counted")
        elif not accepted:
            notes.append(f"live {w} ({state.name}) refused a heartbeat")
        yield step(f"heard {w}", nxt, notes)
        for name in ("ready", "drain", "leave"):
            nxt = book.copy()
            getattr(nxt, name)(w, now)
            yield step(f"{name} {w}", nxt, [])
        nxt = book.copy()
        lost = nxt.lose(w, "socket closed", now)
        notes = []
        if lost and (nxt.view(w) is None or nxt.view(w).cause != "socket closed"):  # type: ignore[union-attr]
            notes.append(f"{w} lost without its cause")
        yield step(f"lose {w}", nxt, notes)

    if world.now < world.horizon:
        nxt = book.copy()
        later = now + 1
        overdue = {
            v.worker_id for v in book.views() if v.deadline_at is not None and later >= v.deadline_at
        }
        lost = {t.worker_id for t in nxt.expire(later)}
        notes = []
        if lost != overdue:
            notes.append(f"expire at {later:g} lost {sorted(lost)}, overdue were {sorted(overdue)}")
        for w in lost:
            view = nxt.view(w)
            if view is not None and not (view.cause or "").startswith("heartbeat missed"):
                notes.append(f"{w} expired without a heartbeat cause")
        yield step(f"tick to {later:g}", nxt, notes, now=world.now + 1)


def _check(world: World) -> list[str]:
    book = world.book
    problems = list(world.notes)
    for view in book.views():
        if view.state in TERMINAL:
            if view.deadline_at is not None:
                problems.append(f"terminal {view.worker_id} still has a deadline")
            if view.state is State.LOST and not view.cause:
                problems.append(f"{view.worker_id} lost with no cause")
            continue
        if view.deadline_at is None or view.deadline_at <= world.now:
            problems.append(f"live {view.worker_id} is past its deadline at {world.now}")
        if not fence_at(view.last_heard, book.deadline) < view.last_heard + book.deadline:
            problems.append(f"{view.worker_id}: the agent's fence is not before the authority's deadline")
    expected_next = min((v.deadline_at for v in book.views() if v.deadline_at is not None), default=None)
    if book.next_deadline() != expected_next:
        problems.append(f"next_deadline {book.next_deadline()} but the earliest is {expected_next}")
    return problems


def configurations(small: bool) -> list[Configuration]:
    """Full: 3 agents over 4 s with a 2 s deadline. Small (test suite): 2 agents over 3 s."""
    agents, horizon = (2, 3) if small else (3, 4)
    return [
        Configuration(
            name=f"liveness ({agents} agents, deadline 2 s, {horizon} s)",
            initial=lambda: World(book=LivenessBook(2.0, retain_terminal=agents), agents=agents, horizon=horizon),
            successors=_successors,
            key=World.key,
            check=_check,
        )
    ]

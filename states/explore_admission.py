"""Exhaustive configurations of the admission book for ``python -m states.explore``.

A world is the book plus the bookkeeping of what the clients did to it (which
sessions were created, deleted or rejected, which workers were failed). Sessions
are created in id order — they are interchangeable, so creating "the next one"
instead of "any one" removes symmetric worlds without losing behaviour.

Events: create the next session, delete any live session, make a starting
worker ready, fail a worker, set a worker's capacity to any legal value in
``1..max_capacity``, hold promotions (the server ending queued sessions a batch
at a time; one hold at most) and resume them, and give a session on a failed
worker back to the queue, or all it holds one after another (its worker refused them before they ran: the order of
those given back together is checked too). Illegal actions (shrinking below
what a worker retains, capacity 0, deleting a rejected session, admitting a
held session twice, resuming with no hold) are attempted in every world too:
each must raise its typed error and change nothing, otherwise the world gets a
note and the explorer reports it.

Rules that can only be judged while an event happens (promotion takes queue
heads in order, and none happens while held; nobody lands on a failed worker)
are also recorded as notes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import attrs

from .admission import (
    Admission,
    AdmissionBook,
    AdmissionTransition,
    DuplicateAdmissionSession,
    InvalidSetting,
    Transition,
    UnknownAdmissionSession,
)
from .explore import Configuration
from .worker import ELIGIBLE, State as WorkerState

__all__ = ["configurations", "World"]

NOW = 0.0


@attrs.frozen
class World:
    book: AdmissionBook  # never mutated once built: successors work on a copy
    sessions: int  # how many may be created
    capacities: tuple[int, ...]  # legal capacity values to try
    created: int = 0
    deleted: frozenset[int] = frozenset()
    rejected: frozenset[int] = frozenset()
    failed: frozenset[str] = frozenset()
    requeued: frozenset[int] = frozenset()  # sessions given back to the queue (in admission order, with the rest)
    notes: tuple[str, ...] = ()
    # computed once: the explorer asks for a world's key more than once
    _key: Hashable = attrs.field(init=False, eq=False, repr=False)

    @_key.default
    def _compute_key(self) -> Hashable:
        # deleted and rejected sessions both hold nothing and take no more
        # events, so which of the two a gone session was does not matter; nor
        # does which were given back once they left the queue (only those
        # waiting may pass its size, and nothing gives back a second time)
        queued = set(self.book.queued_ids())
        waiting = frozenset(i for i in self.requeued if sid(i) in queued)
        return (self.book.canonical_key(), self.created, self.deleted | self.rejected, self.failed,
                bool(self.requeued), waiting, self.notes)

    def key(self) -> Hashable:
        return self._key


def sid(index: int) -> str:
    return f"s{index}"


def index_of(session_id: str) -> int:
    return int(session_id[1:])


def _initial(workers: int, capacity: int, queue_size: int, sessions: int, capacities: tuple[int, ...]):
    def initial() -> World:
        book = AdmissionBook(queue_size)
        for i in range(workers):
            book.add_worker(f"w{i}", capacity, NOW)
        return World(book=book, sessions=sessions, capacities=capacities)

    return initial


def _step_notes(
    before: AdmissionBook, transitions: list[Transition], failed: frozenset[str], *, resuming: bool = False,
    given_back: str | None = None,
) -> list[str]:
    """Rules judged on the event itself: FIFO promotion (none while held, but for the resume), no new session
    ahead of queued ones, no landing on a failed worker; a session given back goes to its place in admission
    (here: creation) order."""
    notes = []
    queue = list(before.queued_ids())
    if given_back is not None:
        queue = sorted([*queue, given_back], key=index_of)
        said = [t.queue_position for t in transitions if isinstance(t, AdmissionTransition) and t.kind == "requeued"]
        place = queue.index(given_back) + 1
        if said != [place]:
            notes.append(f"{given_back} given back at {said}, its place in admission order {place}")
    promoted = [t.session_id for t in transitions if isinstance(t, AdmissionTransition) and t.kind == "promoted"]
    if promoted and before.promotions_held and not resuming:
        notes.append(f"promoted {promoted} while promotions were held")
    assigned = [t.session_id for t in transitions if isinstance(t, AdmissionTransition) and t.kind == "assigned"]
    if assigned and before.queued_ids():
        notes.append(f"{assigned} assigned ahead of the queued {queue}")
    dequeued = {t.session_id for t in transitions if isinstance(t, AdmissionTransition) and t.kind == "dequeued"}
    heads = [s for s in queue if s not in dequeued][: len(promoted)]
    if promoted != heads:
        notes.append(f"promoted {promoted} but the queue heads were {heads}")
    for t in transitions:
        if isinstance(t, AdmissionTransition) and t.kind in ("assigned", "promoted") and t.worker_id in failed:
            notes.append(f"{t.session_id} admitted onto failed worker {t.worker_id}")
    return notes


def _admission_notes(book: AdmissionBook, admission: Admission, transitions: list[Transition]) -> list[str]:
    """The answer the client gets agrees with the book and with the transitions."""
    notes = []
    s = admission.session_id
    kinds = [t.kind for t in transitions if isinstance(t, AdmissionTransition)]
    if admission.status == "assigned":
        if book.worker_of(s) != admission.worker_id or kinds != ["assigned"]:
            notes.append(f"{s} answered assigned to {admission.worker_id} but book says {book.worker_of(s)}")
    elif admission.status == "queued":
        if book.queue_position(s) != admission.queue_position or kinds != ["queued"]:
            notes.append(f"{s} answered queued at {admission.queue_position}, book says {book.queue_position(s)}")
    else:
        if book.holds(s) or kinds != ["rejected"]:
            notes.append(f"{s} answered rejected but the book holds it")
    return notes


def _successors(world: World) -> Iterator[tuple[str, World]]:
    book = world.book
    before_key = book.canonical_key()
    live = [i for i in range(world.created) if i not in world.deleted and i not in world.rejected]

    def noted(label: str, problem: str) -> tuple[str, World]:
        return label, attrs.evolve(world, book=book.copy(), notes=(*world.notes, problem))

    # create the next session
    if world.created < world.sessions:
        nxt = book.copy()
        admission, transitions = nxt.admit(sid(world.created), NOW)
        notes = _step_notes(book, transitions, world.failed) + _admission_notes(nxt, admission, transitions)
        queued = book.queued_ids()
        if queued and len(queued) >= book.queue_size and admission.status != "rejected":
            notes.append(f"a create was {admission.status} while the queue {list(queued)} was at or past its size")
        rejected = world.rejected | {world.created} if admission.status == "rejected" else world.rejected
        yield f"create {sid(world.created)}", attrs.evolve(
            world, book=nxt, created=world.created + 1, rejected=rejected, notes=(*world.notes, *notes)
        )

    # delete any live session
    for i in live:
        nxt = book.copy()
        transitions = nxt.release(sid(i), NOW)
        notes = _step_notes(book, transitions, world.failed)
        yield f"delete {sid(i)}", attrs.evolve(
            world, book=nxt, deleted=world.deleted | {i}, notes=(*world.notes, *notes)
        )

    for view in book.workers():
        wid = view.worker_id
        if view.state is WorkerState.STARTING:
            nxt = book.copy()
            transitions = nxt.worker_ready(wid, NOW)
            notes = _step_notes(book, transitions, world.failed)
            yield f"ready {wid}", attrs.evolve(world, book=nxt, notes=(*world.notes, *notes))
        if wid not in world.failed:
            nxt = book.copy()
            transitions = nxt.fail_worker(wid, NOW)
            notes = _step_notes(book, transitions, world.failed | {wid})
            yield f"fail {wid}", attrs.evolve(
                world, book=nxt, failed=world.failed | {wid}, notes=(*world.notes, *notes)
            )
        for capacity in (0, *world.capacities):
            if capacity == view.capacity:
                continue
            label = f"capacity {wid}={capacity}"
            nxt = book.copy()
            if capacity < max(view.retained, 1):
                try:
                    nxt.set_capacity(wid, capacity, NOW)
                except InvalidSetting as error:
                    if error.field != "capacity" or nxt.canonical_key() != before_key:
                        yield noted(label, f"refused {label} changed the book or named {error.field}")
                else:
                    yield noted(label, f"illegal {label} (retains {view.retained}) was accepted")
                continue
            transitions = nxt.set_capacity(wid, capacity, NOW)
            notes = _step_notes(book, transitions, world.failed)
            yield label, attrs.evolve(world, book=nxt, notes=(*world.notes, *notes))

    # give a session on a failed worker back to the queue (the worker refused it as its own state), or every session
    # it holds, one after another in the order they came to it (an agent refusing each Start on its way to it, which
    # checks the order of those given back together); once a world at most, as holds are: a second adds orderings of
    # the same rule, and multiplied the worlds by ten
    for view in book.workers() if not world.requeued else ():
        if view.worker_id not in world.failed:
            continue
        every = [view.session_ids] if len(view.session_ids) > 1 else []
        for given in [*((s,) for s in view.session_ids), *every]:
            nxt, notes = book.copy(), []
            for s in given:
                before = nxt.copy()
                transitions = nxt.requeue_head(s, NOW)
                notes += _step_notes(before, transitions, world.failed, given_back=s)
                if [t.kind for t in transitions if isinstance(t, AdmissionTransition)][:1] != ["requeued"]:
                    notes.append(f"requeue of {s} did not say so first")
            yield f"requeue {' '.join(given)}", attrs.evolve(
                world, book=nxt, requeued=world.requeued | {index_of(s) for s in given}, notes=(*world.notes, *notes)
            )

    # hold promotions (one hold at most: nested holds are a count, and a second adds no behaviour) and resume them
    if not book.promotions_held:
        nxt = book.copy()
        nxt.hold_promotions()
        yield "hold promotions", attrs.evolve(world, book=nxt)
    else:
        nxt = book.copy()
        transitions = nxt.resume_promotions(NOW)
        notes = _step_notes(book, transitions, world.failed, resuming=True)
        yield "resume promotions", attrs.evolve(world, book=nxt, notes=(*world.notes, *notes))

    # refused actions must change nothing (one representative each: the book
    # does not tell gone sessions, or live ones, apart by anything but id)
    for i in sorted(world.rejected | world.deleted)[-1:]:
        nxt = book.copy()
        try:
            nxt.release(sid(i), NOW)
        except UnknownAdmissionSession:
            if nxt.canonical_key() != before_key:
                yield noted(f"delete {sid(i)} again", "refused release changed the book")
        else:
            yield noted(f"delete {sid(i)} again", f"release of gone session {sid(i)} was accepted")
    if not book.promotions_held:
        nxt = book.copy()
        try:
            nxt.resume_promotions(NOW)
        except InvalidSetting:
            if nxt.canonical_key() != before_key:
                yield noted("resume unheld", "refused resume changed the book")
        else:
            yield noted("resume unheld", "a resume with no hold was accepted")
    for i in live[:1]:
        nxt = book.copy()
        try:
            nxt.admit(sid(i), NOW)
        except DuplicateAdmissionSession:
            if nxt.canonical_key() != before_key:
                yield noted(f"admit {sid(i)} twice", "refused admit changed the book")
        else:
            yield noted(f"admit {sid(i)} twice", f"duplicate admit of {sid(i)} was accepted")


def _check(world: World) -> list[str]:
    book = world.book
    problems = list(world.notes)
    queue = list(book.queued_ids())
    views = book.workers()
    seen: dict[str, str] = {}
    for view in views:
        if view.retained > view.capacity:
            problems.append(f"{view.worker_id} retains {view.retained} > capacity {view.capacity}")
        for s in view.session_ids:
            if s in seen:
                problems.append(f"{s} retained by {seen[s]} and {view.worker_id}")
            seen[s] = view.worker_id
            if book.worker_of(s) != view.worker_id:
                problems.append(f"{s} on {view.worker_id} but worker_of says {book.worker_of(s)}")
            if s in queue:
                problems.append(f"{s} both queued and assigned to {view.worker_id}")
        # worker state agrees with what it retains
        if view.state in (WorkerState.STARTING, WorkerState.STOPPED, WorkerState.IDLE) and view.retained:
            problems.append(f"{view.worker_id} is {view.state.name} but retains {view.retained}")
        if view.state is WorkerState.BUSY and not view.retained:
            problems.append(f"{view.worker_id} is BUSY but retains nothing")
    # every session waits in creation (admission) order, those given back included
    if [index_of(s) for s in queue] != sorted(index_of(s) for s in queue):
        problems.append(f"queue {queue} is not in creation order")
    plain = [index_of(s) for s in queue if index_of(s) not in world.requeued]
    positions = [book.queue_position(s) for s in queue]
    if positions != list(range(1, len(queue) + 1)):
        problems.append(f"queue positions {positions} are not 1..{len(queue)}")
    if len(plain) > book.queue_size:  # one given back was admitted already: it may take the queue past its size
        problems.append(f"queue length {len(queue)} > queue_size {book.queue_size}")
    if queue and not book.promotions_held:  # while held, room may wait for the resume
        for view in views:
            if view.state in ELIGIBLE and view.retained < view.capacity:
                problems.append(f"{view.worker_id} has room while {len(queue)} wait")
    for i in range(world.created):
        s = sid(i)
        gone = i in world.deleted or i in world.rejected
        if gone and book.holds(s):
            problems.append(f"{s} was {'deleted' if i in world.deleted else 'rejected'} but the book holds it")
        if not gone and not book.holds(s):
            problems.append(f"live {s} is neither queued nor assigned")
    for i in range(world.created, world.sessions):
        if book.holds(sid(i)):
            problems.append(f"{sid(i)} held before it was created")
    snap = book.snapshot()
    if snap.queued != len(queue) or snap.retained != len(seen):
        problems.append(f"snapshot {snap} disagrees with the book")
    return problems


def _configuration(
    name: str, *, workers: int, capacity: int, queue_size: int, sessions: int, max_capacity: int
) -> Configuration:
    return Configuration(
        name=name,
        initial=_initial(workers, capacity, queue_size, sessions, tuple(range(1, max_capacity + 1))),
        successors=_successors,
        key=World.key,
        check=_check,
    )


def configurations(small: bool) -> list[Configuration]:
    """Full: 2 workers x 2 slots, queue 2, 6 sessions. Small (test suite): 4 sessions."""
    sessions = 4 if small else 6
    return [
        _configuration(
            f"admission (2 workers x 2 slots, queue 2, {sessions} sessions)",
            workers=2,
            capacity=2,
            queue_size=2,
            sessions=sessions,
            max_capacity=3,
        )
    ]

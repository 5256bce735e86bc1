"""Who runs the next model chunk: the execution-lease book (pure, no clock).

Theory of operation
-------------------
Many admitted sessions share one model service; the book decides whose chunk
runs next. Each session's lifecycle (waiting, queued, active, parked, closing)
lives only in its :class:`~states.lease.LeaseMachine` and moves only through
``apply``; the book owns the multi-session facts around it: the FIFO of queued
sessions, each session's last activity stamp, whether a chunk is in flight
(``busy``), whether the holder has run a chunk since it was granted, and
whether a waiter is owed a guaranteed chunk.

Rules (reference B.8, with the F.26 weakness fixed):

* ``record_activity`` stamps activity; a waiting or parked session joins the
  FIFO tail. If it queues while the lease is held by someone else (an active
  session, or a closing session whose last chunk is still running), it is
  *protected*: once granted it is guaranteed one chunk before it can be
  parked, even if its own activity is stale by then. Then, if another session
  holds the lease, has run a chunk since its grant, is not mid-chunk and is
  idle-expired, it is parked; then the FIFO head is granted if the lease is
  free.
* ``begin_chunk`` / ``finish_chunk`` bracket one chunk of the holder. The lease
  changes hands only at a chunk boundary: ``finish_chunk`` parks an
  idle-expired holder when someone waits and grants the next; ``tick`` (a
  periodic timer) does the same for a holder between chunks that has run since
  its grant. A parked session is granted again only after new activity.
* Rotation (opt-in, ``rotate=True``; the reference rules have none, so a
  holder that keeps sending controls keeps the lease for ever): at
  ``finish_chunk``, when someone waits and the holder is *not* idle-expired,
  the holder YIELDs -- it goes back to the FIFO tail (QUEUED) and the head is
  granted, so continuously active sessions take turns chunk by chunk. An
  idle-expired holder is PARKED exactly as without rotation. The yielded
  session has just run, so it is not owed a chunk: it is unprotected when it
  is granted again. ``tick``, ``record_activity`` and ``abort_chunk`` never
  yield (only the holder's own completed chunk is a rotation boundary), and
  nobody yields when nobody waits.
* ``relinquish`` is the holder's own declaration, between chunks, that it
  has nothing to run right now: the ACTIVE holder is PARKED whatever its
  activity stamp and whether or not anyone waits, and the FIFO head (if any)
  is granted. It is owed nothing (its guaranteed chunk, if still pending, is
  forfeited) and, like any parked session, is granted again only after new
  activity, which queues it at the tail. Only the ACTIVE holder may
  relinquish (``NotHolder``), and not mid-chunk (``ChunkInProgress``).
* The driver's word (the rules ``pipelines/lease.py`` used to keep on its own,
  now here where the explorer sees them). ``declare_idle`` says the session's
  driver has nothing to run (it waits for input); ``request_turn`` says it has
  a chunk to run. Whenever an idle-declared holder is between chunks and
  someone waits, the book relinquishes for it (after every call). A WAITING or
  PARKED session returns to the FIFO only on a *new* valid control: a control
  that arrives while its driver is idle-declared is remembered (``fresh``) and
  queues it at its driver's next ``request_turn``; a ``request_turn`` with no
  control since it was parked queues nothing (the driver waits for one). So a
  held key is activity only while the controller keeps refreshing it: a
  session parked for idleness with a key still held stays parked until its
  controller sends again.
* ``close`` ends a session's claim from any live state. Closing the holder
  frees the lease at once and grants the next waiter -- unless the holder is
  mid-chunk, in which case the lease stays occupied by that chunk (the closing
  session is no longer ACTIVE, but no one else may run) until ``finish_chunk``
  or ``abort_chunk`` reports the chunk over, which grants the next waiter.
  ``release`` forgets a closing entry whose chunk (if any) is over.

Times are plain floats passed in by the caller. Mutating methods return the
:class:`LeaseTransition` list they made (in order); on error they raise a
:class:`LeaseError` subclass and change nothing.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from . import lease_values
from .lease import TERMINAL, Event, LeaseMachine, State
from .lease_values import (
    ChunkInProgress,
    DuplicateLeaseSession,
    LeaseError,
    LeaseSnapshot,
    LeaseTransition,
    NoChunkInProgress,
    NotClosing,
    NotHolder,
    SessionClosing,
    UnknownLeaseSession,
)

__all__ = ["LeaseBook", *lease_values.__all__]


@attrs.define
class _Entry:
    machine: LeaseMachine
    last_activity_at: float
    busy: bool = False
    has_run_since_grant: bool = False
    protect_next_grant: bool = False
    idle: bool = False  # its driver declared it has nothing to run
    fresh: bool = False  # a control arrived since it last queued, parked or relinquished

    @property
    def state(self) -> State:
        return self.machine.state


def _check_idle_timeout(value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"idle_timeout must be a number > 0, got {value!r}")


# ----------------------------------------------------------------------- book


class LeaseBook:
    """The FIFO execution lease over many sessions (see the module docstring)."""

    __slots__ = ("_idle_timeout", "_rotate", "_entries", "_fifo")

    def __init__(self, idle_timeout: float, *, rotate: bool = False) -> None:
        _check_idle_timeout(idle_timeout)
        if not isinstance(rotate, bool):
            raise TypeError(f"rotate must be a bool, got {rotate!r}")
        self._idle_timeout = float(idle_timeout)
        self._rotate = rotate
        self._entries: dict[str, _Entry] = {}
        self._fifo: list[str] = []

    # ------------------------------------------------------------ queries

    @property
    def idle_timeout(self) -> float:
        return self._idle_timeout

    @property
    def rotate(self) -> bool:
        """Whether a busy (non-idle) holder yields to waiters at its chunk boundary."""
        return self._rotate

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def sessions(self) -> tuple[str, ...]:
        """Known session ids in registration order (closing ones until released)."""
        return tuple(self._entries)

    def holder(self) -> str | None:
        """The ACTIVE session, if any."""
        for session_id, entry in self._entries.items():
            if entry.state is State.ACTIVE:
                return session_id
        return None

    def draining(self) -> str | None:
        """A closing session whose last chunk is still running (it blocks grants)."""
        for session_id, entry in self._entries.items():
            if entry.state is State.CLOSING and entry.busy:
                return session_id
        return None

    def lease_free(self) -> bool:
        """Nobody holds the lease and no chunk is in flight."""
        return self.holder() is None and self.draining() is None

    def queued(self) -> tuple[str, ...]:
        """The FIFO of queued sessions, head first."""
        return tuple(self._fifo)

    def state(self, session_id: str) -> State:
        return self._entry(session_id).state

    def closing(self, session_id: str) -> bool:
        """Whether the session's claim has ended (it takes no more turns; forgotten once no chunk of it runs)."""
        return self._entry(session_id).state in TERMINAL

    def queue_position(self, session_id: str) -> int | None:
        """1-based position in the FIFO, or None when not queued."""
        self._entry(session_id)
        try:
            return self._fifo.index(session_id) + 1
        except ValueError:
            return None

    def is_busy(self, session_id: str) -> bool:
        return self._entry(session_id).busy

    def last_activity_at(self, session_id: str) -> float:
        return self._entry(session_id).last_activity_at

    def is_idle_expired(self, session_id: str, now: float) -> bool:
        return self._expired(self._entry(session_id), now)

    def is_idle_declared(self, session_id: str) -> bool:
        """Its driver said it has nothing to run, and has not asked for a turn since."""
        return self._entry(session_id).idle

    def has_fresh_activity(self, session_id: str) -> bool:
        """A control arrived since it last queued, parked or relinquished."""
        return self._entry(session_id).fresh

    def snapshot(self) -> tuple[LeaseSnapshot, ...]:
        """Every known session, in registration order."""
        positions = {session_id: index + 1 for index, session_id in enumerate(self._fifo)}
        return tuple(
            LeaseSnapshot(
                session_id=session_id,
                state=entry.state,
                last_activity_at=entry.last_activity_at,
                busy=entry.busy,
                queue_position=positions.get(session_id),
            )
            for session_id, entry in self._entries.items()
        )

    def canonical_key(self, now: float) -> Hashable:
        """A hashable form in which times are reduced to "idle-expired at ``now``".

        Two books with equal keys behave the same from ``now`` on as long as
        time only moves in steps of at least ``idle_timeout`` between
        activities (what the exhaustive explorer does).
        """
        return (
            self._rotate,
            tuple(
                (
                    session_id,
                    entry.state.value,
                    entry.busy,
                    entry.has_run_since_grant,
                    entry.protect_next_grant,
                    entry.idle,
                    entry.fresh,
                    self._expired(entry, now),
                )
                for session_id, entry in sorted(self._entries.items())
            ),
            tuple(self._fifo),
        )

    def clone(self) -> LeaseBook:
        """An independent copy (cheaper than ``copy.deepcopy``, same result)."""
        twin = LeaseBook.__new__(LeaseBook)
        twin._idle_timeout = self._idle_timeout
        twin._rotate = self._rotate
        twin._entries = {
            session_id: _Entry(
                machine=LeaseMachine(entry.state),
                last_activity_at=entry.last_activity_at,
                busy=entry.busy,
                has_run_since_grant=entry.has_run_since_grant,
                protect_next_grant=entry.protect_next_grant,
                idle=entry.idle,
                fresh=entry.fresh,
            )
            for session_id, entry in self._entries.items()
        }
        twin._fifo = list(self._fifo)
        return twin

    def __deepcopy__(self, memo: dict) -> LeaseBook:
        twin = self.clone()
        memo[id(self)] = twin
        return twin

    def __copy__(self) -> LeaseBook:
        return self.clone()

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{sid}={entry.state.name}{'*' if entry.busy else ''}"
            for sid, entry in self._entries.items()
        )
        rotate = " rotate" if self._rotate else ""
        return f"<LeaseBook{rotate} [{inner}] fifo={self._fifo}>"

    # ----------------------------------------------------------- mutations

    def register(self, session_id: str, now: float) -> list[LeaseTransition]:
        """A new session, WAITING (it has not asked to run yet)."""
        if session_id in self._entries:
            raise DuplicateLeaseSession(session_id, "already registered")
        self._entries[session_id] = _Entry(machine=LeaseMachine(), last_activity_at=now)
        return [LeaseTransition(session_id, State.WAITING)]

    def record_activity(self, session_id: str, now: float) -> list[LeaseTransition]:
        """A valid control arrived: stamp; queue a waiting or parked session unless its driver is
        idle-declared (then remember it for its next ``request_turn``); maybe park an idle holder; grant."""
        entry = self._entry(session_id)
        if entry.state is State.CLOSING:
            return []  # a late control racing teardown
        entry.last_activity_at = now
        entry.fresh = True
        if entry.state in (State.WAITING, State.PARKED):
            if entry.idle:
                return self._settle()
            return self._enqueue(session_id, now) + self._settle()
        entry.machine.apply(Event.ACTIVITY)  # refreshes a queued or active session
        return self._park_expired_holder(session_id, now) + self._grant_if_free() + self._settle()

    def request_turn(self, session_id: str, now: float) -> list[LeaseTransition]:
        """The session's driver has a chunk to run: clears its idle mark; a waiting or parked
        session queues only if a control came since it last left the lease (else it must wait for one)."""
        entry = self._entry(session_id)
        if entry.state is State.CLOSING:
            return []
        entry.idle = False
        if entry.state in (State.WAITING, State.PARKED) and entry.fresh:
            return self._enqueue(session_id, now) + self._settle()
        return self._settle()

    def declare_idle(self, session_id: str) -> list[LeaseTransition]:
        """The session's driver has nothing to run: an idle-declared holder between chunks steps aside
        for whoever waits (now, or whenever someone queues)."""
        entry = self._entry(session_id)
        if entry.state is State.CLOSING:
            return []
        entry.idle = True
        return self._settle()

    def _enqueue(self, session_id: str, now: float) -> list[LeaseTransition]:
        entry = self._entries[session_id]
        occupant = self.holder() or self.draining()
        entry.machine.apply(Event.ACTIVITY)
        entry.fresh = False  # this control is used up by queuing
        self._fifo.append(session_id)
        entry.protect_next_grant = occupant is not None and occupant != session_id
        transitions = [LeaseTransition(session_id, State.QUEUED)]
        transitions.extend(self._park_expired_holder(session_id, now))
        transitions.extend(self._grant_if_free())
        return transitions

    def _park_expired_holder(self, session_id: str, now: float) -> list[LeaseTransition]:
        """Activity of ``session_id``: another holder between chunks, idle-expired after its chunk, is parked."""
        holder = self.holder()
        if holder is not None and holder != session_id:
            held = self._entries[holder]
            if held.has_run_since_grant and not held.busy and self._expired(held, now):
                return [self._park(holder)]
        return []

    def _settle(self) -> list[LeaseTransition]:
        """While an idle-declared holder is between chunks and someone waits, relinquish for it.

        Terminates: each round parks one session, and a parked one is queued again only by
        a new control, which this loop never makes."""
        transitions: list[LeaseTransition] = []
        while True:
            holder = self.holder()
            if holder is None or not self._fifo:
                return transitions
            entry = self._entries[holder]
            if not entry.idle or entry.busy:
                return transitions
            transitions += self._relinquish(holder)

    def begin_chunk(self, session_id: str) -> list[LeaseTransition]:
        """The ACTIVE holder starts one chunk (returns no transitions)."""
        entry = self._entry(session_id)
        if entry.state is not State.ACTIVE:
            raise NotHolder(session_id, f"cannot begin a chunk while {entry.state.name}")
        if entry.busy:
            raise ChunkInProgress(session_id, "a chunk is already running")
        entry.busy = True
        entry.has_run_since_grant = True
        return []

    def finish_chunk(self, session_id: str, now: float) -> list[LeaseTransition]:
        """A chunk ended: the one boundary where an idle holder hands off (parks)
        and, with rotation, a non-idle holder yields to the next waiter."""
        entry = self._entry(session_id)
        if not entry.busy:
            raise NoChunkInProgress(session_id, "no chunk is running")
        entry.busy = False
        transitions: list[LeaseTransition] = []
        if entry.state is State.ACTIVE and self._fifo and entry.has_run_since_grant:
            if self._expired(entry, now):
                transitions.append(self._park(session_id))
            elif self._rotate:
                transitions.append(self._yield(session_id))
        transitions.extend(self._grant_if_free())
        return transitions + self._settle()

    def relinquish(self, session_id: str, now: float) -> list[LeaseTransition]:
        """The holder, between chunks, has nothing to run: park it and grant the next.

        ``now`` is accepted for symmetry with the other timed calls; the
        relinquish itself does not depend on the holder's activity stamp.
        """
        entry = self._entry(session_id)
        if entry.state is not State.ACTIVE:
            raise NotHolder(session_id, f"cannot relinquish while {entry.state.name}")
        if entry.busy:
            raise ChunkInProgress(session_id, "cannot relinquish mid-chunk")
        return self._relinquish(session_id) + self._settle()

    def _relinquish(self, session_id: str) -> list[LeaseTransition]:
        entry = self._entries[session_id]
        entry.machine.apply(Event.RELINQUISH)
        entry.has_run_since_grant = False
        entry.protect_next_grant = False  # it gave the lease up: owed nothing
        entry.fresh = False  # back in the FIFO only on a new control
        return [LeaseTransition(session_id, State.PARKED), *self._grant_if_free()]

    def abort_chunk(self, session_id: str) -> list[LeaseTransition]:
        """A chunk failed: clear busy. An active holder keeps the lease (a later
        tick or finish decides); a closing session's aborted chunk frees it."""
        entry = self._entry(session_id)
        if not entry.busy:
            raise NoChunkInProgress(session_id, "no chunk is running")
        entry.busy = False
        return self._grant_if_free() + self._settle()

    def tick(self, now: float) -> list[LeaseTransition]:
        """Periodic timer: hand off from an idle holder between chunks if someone waits."""
        transitions: list[LeaseTransition] = []
        holder = self.holder()
        if holder is not None and self._fifo:
            entry = self._entries[holder]
            if entry.has_run_since_grant and not entry.busy and self._expired(entry, now):
                transitions.append(self._park(holder))
        transitions.extend(self._grant_if_free())
        return transitions + self._settle()

    def close(self, session_id: str) -> list[LeaseTransition]:
        """End the session's claim; a holder between chunks frees the lease at once."""
        entry = self._entry(session_id)
        if entry.state is State.CLOSING:
            raise SessionClosing(session_id, "already closing")
        if entry.state is State.QUEUED:
            self._fifo.remove(session_id)
        entry.machine.apply(Event.CLOSE)
        entry.protect_next_grant = False
        entry.idle = entry.fresh = False
        return [LeaseTransition(session_id, State.CLOSING), *self._grant_if_free(), *self._settle()]

    def release(self, session_id: str) -> list[LeaseTransition]:
        """Forget a closing session whose chunk (if any) is over."""
        entry = self._entry(session_id)
        if entry.state is not State.CLOSING:
            raise NotClosing(session_id, f"cannot release while {entry.state.name}")
        if entry.busy:
            raise ChunkInProgress(session_id, "finish or abort its chunk before release")
        del self._entries[session_id]
        return []

    # ------------------------------------------------------------- helpers

    def _entry(self, session_id: str) -> _Entry:
        try:
            return self._entries[session_id]
        except KeyError:
            raise UnknownLeaseSession(session_id, "not registered") from None

    def _expired(self, entry: _Entry, now: float) -> bool:
        return now - entry.last_activity_at >= self._idle_timeout

    def _park(self, session_id: str) -> LeaseTransition:
        entry = self._entries[session_id]
        entry.machine.apply(Event.PARK)
        entry.has_run_since_grant = False
        entry.fresh = False  # back in the FIFO only on a new control
        return LeaseTransition(session_id, State.PARKED)

    def _yield(self, session_id: str) -> LeaseTransition:
        entry = self._entries[session_id]
        entry.machine.apply(Event.YIELD)
        entry.has_run_since_grant = False
        entry.protect_next_grant = False  # it has just run: not owed a chunk
        self._fifo.append(session_id)
        return LeaseTransition(session_id, State.QUEUED)

    def _grant_if_free(self) -> list[LeaseTransition]:
        if not self._fifo or not self.lease_free():
            return []
        session_id = self._fifo.pop(0)
        entry = self._entries[session_id]
        entry.machine.apply(Event.GRANT)
        entry.has_run_since_grant = not entry.protect_next_grant
        entry.protect_next_grant = False
        return [LeaseTransition(session_id, State.ACTIVE)]

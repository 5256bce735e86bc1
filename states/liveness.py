"""Liveness of worker agents as the authority sees them: registration, heartbeats, drain, loss.

Theory of operation
-------------------
A worker agent dials in to the authority and registers under a fresh id
(CONNECTED while it loads its pipeline). READY makes it live for admission.
Every message it sends counts as a HEARTBEAT: it moves the worker's deadline to
``now + deadline``. DRAIN takes it out of admission while its sessions finish;
LEAVE ends a drained worker that said goodbye. LOSE ends a worker at once, with
a cause: its socket closed, its heartbeat deadline passed (:meth:`expire`), or
the launcher reported its process exited or its Ray actor died. LOST and LEFT are terminal:
the id is never live again, and whatever it still sends — a late session event,
a heartbeat that was in flight — is a *stale* message, dropped and counted.

The agent's side of the same clock is :func:`fence_at`: an agent that has not
had a heartbeat acknowledged stops its own sessions at ``sent + deadline *
FENCE_FRACTION``, where ``sent`` is when it sent the newest acknowledged
heartbeat. The authority received that heartbeat no earlier than ``sent``, so
it cannot declare the agent lost before ``sent + deadline``: the agent has
fenced itself first, and no session runs on two workers at once.

A worker that registers must also say READY within ``ready_within`` seconds (when the book
has one): heartbeats alone keep a CONNECTED worker alive, and one that never becomes ready
would hold its place in admission (sessions queued for it) for ever. :meth:`expire` loses it.
Likewise a draining worker given a deadline (``drain(..., within=)``) that has not said
goodbye by then is lost: its sessions cannot outlive the drain. And a worker that owes a
session's finish (:meth:`owe_stop`: it was asked to stop the session, or said it drains it)
must report it finished (:meth:`stop_answered`) within the time it was given: heartbeats alone
kept a worker that never stopped its session (its slot taken, its DELETE answered ``draining``
for ever) alive for as long as it stayed connected.

The book is pure: no clock (every method that needs time takes ``now``), no
I/O. Terminal entries are kept up to ``retain_terminal`` (oldest forgotten);
a message from a forgotten or never-seen id is stale too.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

import attrs

from .machine import StateMachine, TableEnum

__all__ = [
    "State",
    "Event",
    "TRANSITIONS",
    "TERMINAL",
    "ADMITTING",
    "AWAITING_READY",
    "DRAINING_STATES",
    "FENCE_FRACTION",
    "LivenessMachine",
    "LivenessBook",
    "LivenessTransition",
    "WorkerLiveness",
    "DuplicateWorkerId",
    "InvalidLiveness",
    "fence_at",
    "fences_agents",
    "stall_cause",
    "fenced",
    "FENCES",
    "loss_kind",
    "LOSS_KINDS",
    "PROCESS_GONE",
]

FENCE_FRACTION = 0.5


class State(TableEnum):
    CONNECTED = "connected"
    READY = "ready"
    DRAINING = "draining"
    LOST = "lost"
    LEFT = "left"


class Event(TableEnum):
    HEARTBEAT = "heartbeat"
    READY = "ready"
    DRAIN = "drain"
    LEAVE = "leave"
    LOSE = "lose"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.CONNECTED, Event.HEARTBEAT): State.CONNECTED,
    (State.READY, Event.HEARTBEAT): State.READY,
    (State.DRAINING, Event.HEARTBEAT): State.DRAINING,
    (State.CONNECTED, Event.READY): State.READY,
    (State.CONNECTED, Event.DRAIN): State.DRAINING,
    (State.READY, Event.DRAIN): State.DRAINING,
    (State.DRAINING, Event.LEAVE): State.LEFT,
    (State.CONNECTED, Event.LOSE): State.LOST,
    (State.READY, Event.LOSE): State.LOST,
    (State.DRAINING, Event.LOSE): State.LOST,
}

TERMINAL = frozenset({State.LOST, State.LEFT})

# A worker in these states may be offered new sessions (the admission book decides which).
ADMITTING = frozenset({State.READY})

# A worker in these states has registered but not said READY (bounded by the book's ``ready_within``).
AWAITING_READY = frozenset({State.CONNECTED})

# A worker in these states should leave by its drain deadline (``drain(..., within=)``).
DRAINING_STATES = frozenset({State.DRAINING})


class LivenessMachine(StateMachine[State, Event]):
    NAME = "worker liveness"
    TABLE = TRANSITIONS
    INITIAL = State.CONNECTED
    TERMINAL = TERMINAL


class InvalidLiveness(ValueError):
    """A setting or argument the book cannot accept; ``field`` names it."""

    def __init__(self, field: str, value: object, why: str) -> None:
        self.field = field
        super().__init__(f"{field}={value!r}: {why}")


class DuplicateWorkerId(ValueError):
    """A worker registered with an id the book already holds (agents take a fresh id every start)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker id {worker_id!r} is already registered; an agent takes a fresh id every start")


def fence_at(acknowledged_sent_at: float, deadline: float) -> float:
    """When an agent must stop its sessions if no newer heartbeat is acknowledged."""
    return acknowledged_sent_at + deadline * FENCE_FRACTION


@attrs.frozen
class LivenessTransition:
    """One event applied to a worker; ``cause`` says why a worker was lost."""

    worker_id: str
    event: Event
    state: State
    at: float
    cause: str | None = None
    kind: Literal["liveness"] = "liveness"


@attrs.frozen
class WorkerLiveness:
    """A read-only picture of one worker's liveness."""

    worker_id: str
    state: State
    registered_at: float
    last_heard: float
    deadline_at: float | None  # None once terminal
    cause: str | None

    def heartbeat_age(self, now: float) -> float:
        return max(0.0, now - self.last_heard)


@attrs.define(slots=True)
class _Entry:
    machine: LivenessMachine
    registered_at: float
    last_heard: float
    cause: str | None = None
    leave_by: float | None = None  # a draining worker's deadline to say goodbye (None: no limit)
    drained_at: float | None = None  # when its drain began
    #: session id -> when the deadline of its finish passes, and that deadline's words in a loss cause
    stops_owed: dict[str, tuple[float, str]] = attrs.Factory(dict)


#: a loss cause's first words and the bounded Prometheus label it is counted under. Each cause says only what the
#: authority knows: its own observations (the socket, the heartbeat clock, the protocol), an agent's word on itself
#: (said so, as its word), and a launcher's notices (it saw the process exit, with its code or signal; Ray said the
#: actor died, or raised something else, which says nothing of the actor).
LOSS_KINDS = (
    ("the authority stalled", "authority_stalled"),
    ("heartbeat missed", "heartbeat_missed"),
    ("connection", "connection_closed"),
    ("process exited", "process_exited"),
    ("the agent said it failed", "agent_failed"),
    ("actor died", "actor_died"),
    ("actor unreachable", "actor_unreachable"),
)

#: losses whose agent process is known to be gone: a launcher has nothing left to end
PROCESS_GONE = frozenset({"process_exited", "actor_died"})


#: loss kinds that are the authority's verdict on the heartbeat clock, not the agent failing: it heard the agent too
#: late (or not at all), or its own stall fenced the agent. The agent is told so (a transient loss notice) and dials
#: again without counting it toward its crash-loop limit, as it does after fencing itself.
FENCES = frozenset({"heartbeat_missed", "authority_stalled"})

#: loss kinds an authority's stall explains when they follow it: the agent fenced itself meanwhile and closed its
#: connection, or the authority, running again, found its heartbeats overdue
STALL_EXPLAINS = frozenset({"heartbeat_missed", "connection_closed"})


def fences_agents(stall: float, deadline: float) -> bool:
    """Whether the authority, not running for ``stall`` seconds, left its agents with no heartbeat acknowledged for
    as long as :func:`fence_at` gives them: they fenced themselves, and the losses that follow are its own doing."""
    return stall >= deadline * FENCE_FRACTION


def stall_cause(cause: str, stall: float, since: float, deadline: float) -> str:
    """A loss's cause as the authority tells it, ``since`` seconds after a stall of its own of ``stall`` seconds: one
    the stall explains (:data:`STALL_EXPLAINS`, within a deadline of it) names the stall, which read ``heartbeat
    missed`` and blamed the agent; any other cause is kept."""
    if fences_agents(stall, deadline) and 0 <= since <= deadline and loss_kind(cause) in STALL_EXPLAINS:
        return f"the authority stalled for {stall:.1f} s (its event loop did not run): the agent was fenced by the stall"
    return cause


def fenced(cause: str) -> bool:
    """Whether a loss cause is a fence (:data:`FENCES`), not the agent failing."""
    return loss_kind(cause) in FENCES


def loss_kind(cause: str) -> str:
    """The bounded Prometheus label of a loss cause (this book's own, an agent's word, the launchers' notices)."""
    for prefix, kind in LOSS_KINDS:
        if cause.startswith(prefix):
            return kind
    return "protocol_error"


class LivenessBook:
    """Registered workers, their heartbeat deadlines, and the count of stale messages dropped."""

    __slots__ = ("_deadline", "_ready_within", "_retain", "_entries", "_gone", "stale_dropped")

    def __init__(self, deadline: float, *, retain_terminal: int = 64, ready_within: float | None = None) -> None:
        if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not deadline > 0:
            raise InvalidLiveness("deadline", deadline, "must be a number of seconds > 0")
        if ready_within is not None and (
            isinstance(ready_within, bool) or not isinstance(ready_within, int | float) or not ready_within > 0
        ):
            raise InvalidLiveness("ready_within", ready_within, "must be a number of seconds > 0, or None")
        if isinstance(retain_terminal, bool) or not isinstance(retain_terminal, int) or retain_terminal < 0:
            raise InvalidLiveness("retain_terminal", retain_terminal, "must be an integer >= 0")
        self._deadline = float(deadline)
        self._ready_within = None if ready_within is None else float(ready_within)
        self._retain = retain_terminal
        self._entries: dict[str, _Entry] = {}
        self._gone: list[str] = []  # terminal ids, oldest first (for bounded retention)
        self.stale_dropped = 0

    @property
    def deadline(self) -> float:
        return self._deadline

    # -- copying and keys (the explorer copies worlds) --

    def copy(self) -> LivenessBook:
        other = LivenessBook.__new__(LivenessBook)
        other._deadline = self._deadline
        other._ready_within = self._ready_within
        other._retain = self._retain
        other._entries = {
            wid: _Entry(LivenessMachine(e.machine.state), e.registered_at, e.last_heard, e.cause, e.leave_by,
                        e.drained_at, dict(e.stops_owed))
            for wid, e in self._entries.items()
        }
        other._gone = list(self._gone)
        other.stale_dropped = self.stale_dropped
        return other

    def canonical_key(self, now: float) -> Hashable:
        """What decides future behaviour: states and how long until each deadline (not absolute
        times); the stale counter only counts, so it is left out."""
        return tuple(
            (wid, e.machine.state, None if e.machine.is_terminal else self._due(e) - now)
            for wid, e in sorted(self._entries.items())
        )

    # -- queries --

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._entries

    def state(self, worker_id: str) -> State | None:
        entry = self._entries.get(worker_id)
        return None if entry is None else entry.machine.state

    def view(self, worker_id: str) -> WorkerLiveness | None:
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        live = not entry.machine.is_terminal
        return WorkerLiveness(
            worker_id,
            entry.machine.state,
            entry.registered_at,
            entry.last_heard,
            self._due(entry) if live else None,
            entry.cause,
        )

    def views(self) -> tuple[WorkerLiveness, ...]:
        return tuple(self.view(wid) for wid in sorted(self._entries))  # type: ignore[misc]

    def live_ids(self) -> tuple[str, ...]:
        return tuple(wid for wid, e in sorted(self._entries.items()) if not e.machine.is_terminal)

    def admitting(self, worker_id: str) -> bool:
        entry = self._entries.get(worker_id)
        return entry is not None and entry.machine.state in ADMITTING

    def next_deadline(self) -> float | None:
        """The earliest deadline among live workers (when :meth:`expire` next matters)."""
        live = [self._due(e) for e in self._entries.values() if not e.machine.is_terminal]
        return min(live) if live else None

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in State}
        for entry in self._entries.values():
            counts[entry.machine.state.value] += 1
        return counts

    # -- moves --

    def register(self, worker_id: str, now: float) -> WorkerLiveness:
        """A new agent connected and authenticated: CONNECTED, its deadline starts now."""
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidLiveness("worker_id", worker_id, "must be a non-empty string")
        if worker_id in self._entries:
            raise DuplicateWorkerId(worker_id)
        self._entries[worker_id] = _Entry(LivenessMachine(), now, now)
        return self.view(worker_id)  # type: ignore[return-value]

    def heard(self, worker_id: str, now: float) -> bool:
        """Any message from the worker: True moves its deadline; False means stale (dropped, counted)."""
        entry = self._entries.get(worker_id)
        if entry is None or not entry.machine.can(Event.HEARTBEAT):
            self.stale_dropped += 1
            return False
        entry.machine.apply(Event.HEARTBEAT)
        entry.last_heard = max(entry.last_heard, now)
        return True

    def ready(self, worker_id: str, now: float) -> list[LivenessTransition]:
        return self._move(worker_id, Event.READY, now)

    def drain(self, worker_id: str, now: float, *, within: float | None = None) -> list[LivenessTransition]:
        """No new sessions for this worker; [] when it is already draining or gone.

        ``within``: seconds it has to say goodbye; :meth:`expire` loses it after that (heartbeats do not help)."""
        moved = self._move(worker_id, Event.DRAIN, now)
        if moved:
            entry = self._entries[worker_id]
            entry.drained_at = now
            entry.leave_by = None if within is None else now + within
        return moved

    def owe_stop(self, worker_id: str, session_id: str, now: float, within: float, *,
                 by: str = "by its stop deadline") -> bool:
        """The worker was asked to stop ``session_id`` (or said it drains it): it must report it finished within
        ``within`` seconds, or :meth:`expire` loses it (heartbeats do not help), the cause saying the session was
        "not reported finished" ``by`` what. False: not live, or that finish is owed already (its first deadline
        stands)."""
        entry = self._entries.get(worker_id)
        if entry is None or entry.machine.is_terminal or session_id in entry.stops_owed:
            return False
        entry.stops_owed[session_id] = (now + within, by)
        return True

    def stop_answered(self, worker_id: str, session_id: str) -> None:
        """The worker reported ``session_id`` finished (or it ended otherwise): no stop of it is owed any more."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            entry.stops_owed.pop(session_id, None)

    def leave(self, worker_id: str, now: float) -> list[LivenessTransition]:
        """A drained worker said goodbye."""
        return self._move(worker_id, Event.LEAVE, now)

    def lose(self, worker_id: str, cause: str, now: float) -> list[LivenessTransition]:
        """The worker is gone (socket closed, launcher's notice...); [] when it already was."""
        return self._move(worker_id, Event.LOSE, now, cause)

    def expire(self, now: float) -> list[LivenessTransition]:
        """Lose every live worker whose heartbeat deadline, ready deadline (still connected), drain deadline or a
        stop's deadline has passed."""
        out: list[LivenessTransition] = []
        for wid, entry in sorted(self._entries.items()):
            if entry.machine.is_terminal or now < self._due(entry):
                continue
            overdue = sorted((due, sid, by) for sid, (due, by) in entry.stops_owed.items() if now >= due)
            if now >= entry.last_heard + self._deadline:
                cause = f"heartbeat missed (nothing heard for {now - entry.last_heard:.1f} s)"
            elif overdue:
                _, session_id, by = overdue[0]
                cause = f"protocol error: session {session_id} not reported finished {by}"
            elif entry.machine.state in DRAINING_STATES:
                # measured from the drain (the time to say goodbye given is the drain's deadline and a grace: "0.0 s
                # past its deadline" said of an agent 15 s past it)
                given = entry.leave_by - entry.drained_at  # type: ignore[operator]
                cause = (f"protocol error: still draining {now - entry.drained_at:.1f} s after its drain began "  # type: ignore[operator]
                         f"(it had {given:g} s to say goodbye)")
            else:
                cause = f"protocol error: not ready {now - entry.registered_at:.1f} s after registering"
            out += self._move(wid, Event.LOSE, now, cause)
        return out

    def _due(self, entry: _Entry) -> float:
        """When a live entry is lost unless it is heard from (or, while connected, says ready)."""
        due = entry.last_heard + self._deadline
        if self._ready_within is not None and entry.machine.state in AWAITING_READY:
            due = min(due, entry.registered_at + self._ready_within)
        if entry.leave_by is not None and entry.machine.state in DRAINING_STATES:
            due = min(due, entry.leave_by)
        if entry.stops_owed:
            due = min(due, *(owed for owed, _ in entry.stops_owed.values()))
        return due

    # -- internals --

    def _move(self, worker_id: str, event: Event, now: float, cause: str | None = None) -> list[LivenessTransition]:
        entry = self._entries.get(worker_id)
        if entry is None or not entry.machine.can(event):
            return []
        state = entry.machine.apply(event)
        if cause is not None:
            entry.cause = cause
        if entry.machine.is_terminal:
            self._gone.append(worker_id)
            while len(self._gone) > self._retain:
                self._entries.pop(self._gone.pop(0), None)
        return [LivenessTransition(worker_id, event, state, now, cause)]

    def __repr__(self) -> str:
        inner = ", ".join(f"{wid}:{e.machine.state.name}" for wid, e in sorted(self._entries.items()))
        return f"<LivenessBook [{inner}] stale={self.stale_dropped}>"

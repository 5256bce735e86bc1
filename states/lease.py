"""Lifecycle of one session's claim on the execution lease.

Theory of operation
-------------------
Many admitted sessions share one model service; the lease says whose chunk
runs next. A session is registered WAITING: it holds a retained slot but has
not asked to run. Its first valid control (ACTIVITY) puts it QUEUED at the tail
of the lease FIFO. The book GRANTs the head when nobody is ACTIVE.

The ACTIVE holder runs whole chunks (the chunk-in-progress flag lives in the
book, because "busy" changes who may move, not what this session is). A
holder that has been idle for ``idle_timeout`` is PARKed, but only at a chunk
boundary and only when someone else waits; a parked session keeps its slot and
caches, and its next ACTIVITY queues it again at the tail. ACTIVITY while
queued or active only refreshes the activity stamp.

Under the reference rules a holder that keeps sending controls is never idle,
so it keeps the lease for ever and every other active session starves. A book
built with rotation on (``LeaseBook(..., rotate=True)``) adds YIELD: at the
end of each of its own chunks, an ACTIVE holder that is not idle but has
someone waiting goes back to QUEUED at the tail of the FIFO and the head is
granted -- round robin at chunk boundaries. An idle holder is still PARKed
(not re-queued: it must ask again), a holder with nobody waiting keeps the
lease, and nothing yields mid-chunk.

RELINQUISH is the holder's own word that it has nothing to run right now
(its driver is about to wait for input): between chunks only, the ACTIVE
holder goes to PARKED and the head of the FIFO is granted at once. Without
it a holder that sends no more chunks -- a session that only wanted its one
preview chunk, or released its keys -- keeps the lease (or, re-queued by a
YIELD, is granted it again) until ``idle_timeout`` parks it, and everyone
waiting starves meanwhile. A relinquished session is parked like any other:
it keeps its slot and caches, is owed nothing, and its next ACTIVITY queues
it again at the tail.

CLOSE ends the claim from any live state (the session is being torn down);
CLOSING is terminal, and the book forgets the entry when it is released.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "LeaseMachine"]


class State(TableEnum):
    WAITING = "waiting"
    QUEUED = "queued"
    ACTIVE = "active"
    PARKED = "parked"
    CLOSING = "closing"


class Event(TableEnum):
    ACTIVITY = "activity"
    GRANT = "grant"
    PARK = "park"
    YIELD = "yield"
    RELINQUISH = "relinquish"
    CLOSE = "close"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.WAITING, Event.ACTIVITY): State.QUEUED,
    (State.PARKED, Event.ACTIVITY): State.QUEUED,
    (State.QUEUED, Event.ACTIVITY): State.QUEUED,
    (State.ACTIVE, Event.ACTIVITY): State.ACTIVE,
    (State.QUEUED, Event.GRANT): State.ACTIVE,
    (State.ACTIVE, Event.PARK): State.PARKED,
    (State.ACTIVE, Event.YIELD): State.QUEUED,
    (State.ACTIVE, Event.RELINQUISH): State.PARKED,
    (State.WAITING, Event.CLOSE): State.CLOSING,
    (State.QUEUED, Event.CLOSE): State.CLOSING,
    (State.ACTIVE, Event.CLOSE): State.CLOSING,
    (State.PARKED, Event.CLOSE): State.CLOSING,
}

TERMINAL = frozenset({State.CLOSING})


class LeaseMachine(StateMachine[State, Event]):
    NAME = "execution lease"
    TABLE = TRANSITIONS
    INITIAL = State.WAITING
    TERMINAL = TERMINAL

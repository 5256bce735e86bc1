"""What a local room hands its worker, and how a sender waits for room in it.

The worker's runner takes the room's events one at a time and may wait on each (a control's round trip to a worker
process, an agent's socket). Data events queue here, :data:`EVENT_BACKLOG` at most and :data:`EVENT_BACKLOG_BYTES`
of payload (one message alone may be larger: the room's own bound on a message holds it); while they are full, the room
stops reading the sender's socket until the worker takes one (:meth:`WorkerInbox.wait_for_room`), so a faster writer's
messages wait in its own socket, TCP pushing back on it. They were dropped, oldest first, without a word: a burst of
500 legal controls to a worker process lost about 240 of them, a ``stop`` among them included. Participant events are
never held back nor dropped (one per join or leave, bounded by the room).

A sender waits at most :data:`WORKER_TAKE_TIMEOUT` for a message: past the runner's own bound on a control
(``CONTROL_TIMEOUT``, 15 s, after which it fails the session as a stalled pipeline and leaves), so that rule acts
first; a message still not taken then is refused to its sender (``worker_stalled``), never dropped without a word.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Generic, TypeVar

import trio

from .base import DataReceived, RoomEvent

__all__ = ["EVENT_BACKLOG", "EVENT_BACKLOG_BYTES", "WORKER_TAKE_TIMEOUT", "WorkerInbox"]

EVENT_BACKLOG = 256  # data events waiting for the worker; past it their senders wait (participant events always go in)
#: their payload bytes: at 1 MiB messages (``--max-data-message-bytes``) the count alone let a room hold 256 MiB
EVENT_BACKLOG_BYTES = 4 * 1024 * 1024
WORKER_TAKE_TIMEOUT = 30.0  # seconds a sender's message may wait for room before it is refused ``worker_stalled``

Item = TypeVar("Item")


class WorkerInbox(Generic[Item]):
    """The worker's queue of room events, in arrival order: data ones counted and bounded by their senders' waits."""

    def __init__(self) -> None:
        self._items: deque[tuple[str | None, int, Item]] = deque()  # (a data event's sender, its bytes, the event)
        self._arrived = trio.Event()
        self._freed = trio.Event()
        self._data = 0
        self._data_bytes = 0
        self.closed = False

    @property
    def queued_data(self) -> int:
        """Data events waiting for the worker (at most EVENT_BACKLOG)."""
        return self._data

    def has_room(self) -> bool:
        """Whether a data event may go in now (a closed inbox takes nothing, so nobody waits for it; an empty one
        takes any message, so one larger than the byte bound still goes)."""
        return self.closed or self._data == 0 or (self._data < EVENT_BACKLOG and self._data_bytes < EVENT_BACKLOG_BYTES)

    async def wait_for_room(self) -> None:
        """Until a data event may go in, or the worker left; the caller bounds the wait."""
        while not self.has_room():
            await self._freed.wait()

    def put(self, item: Item, event: RoomEvent) -> None:
        """Queue ``item``, the worker's form of the room's ``event``: a data event is counted, by its sender and its
        payload's bytes, and goes in only after :meth:`has_room` said so, on the same step. Nothing goes in once
        closed (the room tells a sender so: ``session_ended``)."""
        if self.closed:
            return
        sender, size = None, 0
        if isinstance(event, DataReceived):
            sender, size = event.sender_identity or "", len(event.payload)
            self._data += 1
            self._data_bytes += size
        self._items.append((sender, size, item))
        self._arrived.set()

    async def take(self) -> Item | None:
        """The oldest event, waiting for one; None once the inbox is closed."""
        while not self._items:
            if self.closed:
                return None
            self._arrived = trio.Event()
            await self._arrived.wait()
        sender, size, item = self._items.popleft()
        if sender is not None:
            self._data -= 1
            self._data_bytes -= size
            self._freed.set()
            self._freed = trio.Event()
        return item

    def close(self) -> Counter[str]:
        """The worker left: nothing more goes in, and whoever waits for room or for an event is woken. Returns how
        many data events of each sender it never took (their senders are told)."""
        untaken = Counter(sender for sender, _, _ in self._items if sender is not None)
        self.closed = True
        self._items.clear()
        self._data = self._data_bytes = 0
        self._arrived.set()
        self._freed.set()
        return untaken

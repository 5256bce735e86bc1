"""How fast one participant's data messages are taken in, for every transport.

A person's controls and a page's frame acks are tens a second; one controller writing 23,000 a second took a whole
core and other sessions fell to 1 fps. So each participant's messages are taken at :data:`DATA_MESSAGES_PER_SECOND`
past a burst of :data:`DATA_BURST` (a :class:`~server.token_bucket.TokenBucket` each):

- the local rooms read a participant's socket no faster (:meth:`DataPace.take`): a faster writer's messages wait
  in its own socket, TCP pushes back on it, none is dropped;
- LiveKit delivers every packet, and nothing can push back on the sender, so :class:`LatestWins` keeps, per sender,
  the newest message over the pace in one waiting slot (an older waiting one is dropped: each ``control_state``
  is the whole set of held keys, so the last one sent is the one that counts) and hands it on when the pace, and the
  worker's event backlog, allow.

In the local rooms a message is also paid for by what it makes the room send any one participant
(:meth:`DataPace.sent`): its text as fanned out to each other one, or the worker's answer it may draw, which goes to
its sender alone (a refused control's ``control_rejected``; at most :data:`ANSWER_BYTES`), whichever is more,
:data:`DATA_BYTES_PER_SECOND` past a burst of :data:`DATA_BYTE_BURST`. By count alone a controller's legal burst of
12 KiB messages was 6 MiB (up to three times that once re-encoded), over the 1 MiB a viewer may fall behind before
it is sent away ``too_slow``: its own honest viewers were sent away. Now a burst, and one message past it, fits in a
viewer's backlog with room to spare (``TEXT_BACKLOG_BYTES``/``TEXT_BACKLOG`` in :mod:`.local_room`), and a viewer
that reads a little more than :data:`DATA_BYTES_PER_SECOND` keeps up with whatever a participant may send. A message
sent to several participants counts as a message for each (the room writes it to each), so that one sender costs the
room no more than DATA_MESSAGES_PER_SECOND writes however many read it; the answer is one write, to the sender, at
most one for each message read, so the sender's own pace bounds it (when it went to the whole room, each message
could draw a write to every participant that nothing counted). The local rooms keep each participant's pace (by room
and identity) while it has a socket and after it leaves until the pace is full again (a
:class:`~server.token_bucket.KeptBuckets`, as the front keeps its frame cap): leaving and coming back buys no fresh
burst.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from ..token_bucket import TokenBucket
from .base import DataReceived

__all__ = [
    "ANSWER_BYTES", "DATA_BURST", "DATA_BYTE_BURST", "DATA_BYTES_PER_SECOND", "DATA_MESSAGES_PER_SECOND", "DataPace",
    "LatestWins",
]

DATA_MESSAGES_PER_SECOND = 500
DATA_BURST = 500
DATA_BYTES_PER_SECOND = 256 * 1024  # characters a participant's data may make the room send each other one, a second
DATA_BYTE_BURST = 256 * 1024  # ... past this burst (a quarter of a viewer's backlog, TEXT_BACKLOG_BYTES)
ANSWER_BYTES = 512  # the worker's answer a message may draw, to its sender (a control_rejected echoes <= 64 characters)


class DataPace:
    """One participant's data: :data:`DATA_BURST` messages, then :data:`DATA_MESSAGES_PER_SECOND`; and what they make
    the room send, :data:`DATA_BYTE_BURST` characters, then :data:`DATA_BYTES_PER_SECOND` (the constants are read
    when a pace is made)."""

    def __init__(self, rate: float | None = None, burst: int | None = None) -> None:
        self._messages = TokenBucket(rate or DATA_MESSAGES_PER_SECOND, burst or DATA_BURST)
        self._text = TokenBucket(DATA_BYTES_PER_SECOND, DATA_BYTE_BURST)

    async def take(self) -> None:
        """Wait until this participant may have its next message read (trio's clock): the text its last one made
        the room send is paid for first."""
        debt = -self._text.available(trio.current_time())
        if debt > 0:
            await trio.sleep(debt / self._text.rate)
        seconds = self._messages.wait(trio.current_time())
        if seconds > 0:
            await trio.sleep(seconds)
            self._messages.took_at(trio.current_time())

    def full_at(self, now: float) -> float:
        """When both its buckets are full again (then it is what a new pace is, and may be forgotten)."""
        return max(self._messages.full_at(now), self._text.full_at(now))

    def sent(self, characters: int, recipients: int) -> None:
        """The message just read made the room send ``characters`` to each of ``recipients`` other participants
        (and may draw the worker's answer, to its sender alone): the most any one of them is sent is paid for before
        the next one is read. It counts as a message for each recipient past the first, so that the room writes no
        more than DATA_MESSAGES_PER_SECOND for one sender."""
        now = trio.current_time()
        self._text.charge(now, max(characters, ANSWER_BYTES))
        if recipients > 1:
            self._messages.charge(now, recipients - 1)


class _Timer(Protocol):
    def cancel(self) -> None: ...


class LatestWins:
    """Each sender's data handed to ``accept`` at the pace; over it, the sender's newest message waits in one slot.

    ``accept(event)`` hands a message on, or returns False when the receiver's backlog is full (the message then
    waits, as over the pace). ``now()`` and ``call_later(seconds, fn, *args)`` are the event loop's (callbacks run
    there). ``dropped`` counts the messages a newer one replaced while they waited; the message handed on says how
    many of its sender's it replaced (``DataReceived.replaced``), so that the sender can be told.
    """

    def __init__(
        self,
        accept: Callable[[DataReceived], bool],
        now: Callable[[], float],
        call_later: Callable[..., _Timer],
        *,
        rate: float = DATA_MESSAGES_PER_SECOND,
        burst: int = DATA_BURST,
    ) -> None:
        self._accept = accept
        self._now = now
        self._call_later = call_later
        self._rate = rate
        self._burst = burst
        self._paces: dict[Any, TokenBucket] = {}  # by sender: one per participant in the room
        self._waiting: dict[Any, DataReceived] = {}
        self._timers: dict[Any, _Timer] = {}
        self.dropped = 0
        self._closed = False

    def offer(self, event: DataReceived) -> None:
        """A message arrived: on now, or into its sender's slot (replacing the one there)."""
        if self._closed:
            return
        sender = event.sender_identity
        if (older := self._waiting.get(sender)) is not None:
            self._waiting[sender] = attrs.evolve(event, replaced=older.replaced + 1)
            self.dropped += 1
            return
        if sender not in self._paces:
            self._paces[sender] = TokenBucket(self._rate, self._burst)
        self._waiting[sender] = event
        self._hand_on(sender)

    def forget(self, sender: Any) -> DataReceived | None:
        """The sender left: its pace goes, and its waiting message is returned (for the caller to hand on before the
        leaving, past the backlog: one message a participant that leaves)."""
        timer = self._timers.pop(sender, None)
        if timer is not None:
            timer.cancel()
        self._paces.pop(sender, None)
        return self._waiting.pop(sender, None)

    def close(self) -> None:
        """Nothing more is handed on; the timers are cancelled."""
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._waiting.clear()

    def _hand_on(self, sender: Any) -> None:
        """The sender's waiting message goes on if the pace and the receiver take it now; else it waits its turn."""
        self._timers.pop(sender, None)
        if self._closed or sender not in self._waiting:
            return
        seconds = self._paces[sender].wait(self._now())
        if seconds == 0 and self._accept(self._waiting[sender]):
            del self._waiting[sender]
            return
        self._timers[sender] = self._call_later(seconds or 1 / self._rate, self._hand_on, sender)

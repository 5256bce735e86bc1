"""Who is in each session's room before a worker of the session is in it, kept on its record from its creation.

A queued session's room takes joins (a local room holds the controller's controls for its worker; a LiveKit room
is made at the create), so its record must count them before any worker runs it: its ``participant_count``, and
the token check that refuses an identity already in the room, read the record. On LiveKit a second token for an
identity in the room is worse than a wrong count: LiveKit drops the older participant of that identity, so whoever
asked for the token kicked the user out.

- Local rooms tell one listener a room of each join and leave (``LocalRooms.watch_participants``; a second
  listener would replace the first), so that listener has one owner: the runtime, through this table, for the
  session's whole life. Runners (in-process or an agent's) subscribe to nothing and leave the record's
  participants to it (:attr:`RoomFollow.active`).
- On LiveKit the server is in no room of its own: until the session's worker is in the room and says who is
  there (the runner's events, or an agent's reports: :meth:`RoomFollow.handed_over`), the runtime looks into it
  through the RoomService (``LiveKitTransport.list_participants``). One task looks into the followed rooms one at
  a time, at most :data:`LOOKS_PER_SECOND` looks a second over all of them and each room at most once every
  :data:`LOOK_PERIOD` seconds: with up to ``LOOKS_PER_SECOND * LOOK_PERIOD`` rooms waiting each is seen every
  second, with more (the queue holds at most ``--queue-size``) each less often, never more work. A token asked
  for looks again first (:meth:`RoomFollow.look_now`, paced likewise), so a holder's identity is refused however
  long the queue: one list a room at a time for the checks asked together, at most :data:`TOKEN_LOOKS_PER_SECOND`
  over the server, shared among the rooms (:class:`~server.look_shares.LookShares`: the room listed longest ago
  first, so a flood of token requests for some sessions leaves every other session's checks their lists). Once the
  worker keeps the count a token asked for still lists the room (same pace): the worker's
  word comes a moment after a join returns (its room events; an agent's reports, one a session every 0.5 s), and a
  token for the identity that just joined would be granted in that moment. That list's answer is for the one
  request's refusal check only; the record's count stays the worker's.

Whether a session's room is followed, and by whom, is its machine's state in the table of
:mod:`states.room_follow` (``RoomFollowBook``): this module drives it, and does the watching, the looking and the
clearing.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from states.room_follow import Event as FollowEvent
from states.room_follow import RoomFollowBook

from .cluster.identity import worker_participant
from .log_pace import LogPace
from .look_shares import LookShares
from .transport.base import TransportError

if TYPE_CHECKING:
    from .registry import SessionRecord

__all__ = ["LOOK_PERIOD", "LOOKS_PER_SECOND", "RoomFollow"]

log = logging.getLogger("chunkline.rooms")

LOOKS_PER_SECOND = 20.0  # RoomService lists of the poll a second, over every room it follows together
LOOK_PERIOD = 1.0  # seconds between two looks of the poll into one room, at least
TOKEN_LOOKS_PER_SECOND = 20.0  # fresh looks for token checks a second over every room (shared among the rooms)
TOKEN_LOOK_WAIT = LOOK_PERIOD  # seconds a token's check waits for its room's turn (then the poll's last look decides)


class RoomFollow:
    """The runtime's own view of each session's room until a worker of the session sees it (local rooms: always)."""

    def __init__(self, transport: Any) -> None:
        self._watch: Callable[[str, Callable[[frozenset[str]], None]], None] | None = getattr(
            transport, "watch_participants", None)
        self._unwatch: Callable[[str], None] | None = getattr(transport, "unwatch_participants", None)
        #: LiveKit: who is in a room, as the RoomService lists it (None where the rooms are watched, or not seen)
        self._list: Callable[[str], Awaitable[frozenset[str]]] | None = (
            None if self._watch is not None else getattr(transport, "list_participants", None))
        self._book = RoomFollowBook(
            FollowEvent.WATCH if self._watch is not None
            else FollowEvent.LOOK_INTO if self._list is not None
            else FollowEvent.LEAVE_TO_WORKER)
        self._records: dict[str, SessionRecord] = {}  # the records of the sessions the book holds (for the poll)
        self._more = trio.Event()  # set when a room joins the poll
        self._token_looks: LookShares[frozenset[str]] = LookShares(
            TOKEN_LOOKS_PER_SECOND, int(TOKEN_LOOKS_PER_SECOND), TOKEN_LOOK_WAIT)
        self._tickets = itertools.count()  # each look's place in the order the looks were asked for
        self._under_way: dict[str, _Looks] = {}  # LiveKit: the sessions with a look under way, and their answers
        self._failures = LogPace(log)

    @property
    def followed(self) -> frozenset[str]:
        """The session ids whose rooms are watched or looked into now."""
        return self._book.followed()  # type: ignore[return-value]

    @property
    def active(self) -> bool:
        """Whether rooms are followed here for the sessions' whole lives (local rooms): runners then leave the
        records' participants alone."""
        return self._watch is not None

    def start(self, record: SessionRecord) -> None:
        """Follow the room of a session just admitted or queued, until :meth:`stop` (or, on LiveKit, until
        :meth:`handed_over`)."""
        self._book.start(record.session_id)
        self._records[record.session_id] = record
        if self._list is not None:
            self._token_looks.follow(record.session_id, trio.current_time())
        if self._watch is not None:
            self._watch(record.room, lambda present: moved(record, present))
        if self._book.looks_into(record.session_id):
            self._more.set()

    def handed_over(self, record: SessionRecord) -> None:
        """The session's worker is in its room and says who is there from now on (LiveKit): the runtime stops
        looking (a look under way is dropped), and the record's participants are the worker's to keep."""
        self._book.hand_over(record.session_id)

    def stop(self, record: SessionRecord) -> None:
        """The session ended: its room is not followed any more, and it counts nobody (its room's clients are sent
        away with it; a session that ended queued had no runner to clear them). Idempotent."""
        self._records.pop(record.session_id, None)
        self._token_looks.forget(record.session_id)
        if not self._book.stop(record.session_id):  # the count was not the runtime's (or it stopped already)
            return
        if self._unwatch is not None:
            self._unwatch(record.room)
        record.participants.clear()

    async def look_now(self, record: SessionRecord) -> frozenset[str]:
        """A token is asked for (LiveKit): where the session's room can be listed (the table's CHECK: looked into,
        or handed over to its worker), it is listed now, and who that list saw is returned for the request's
        refusal check, so that an identity in the room is refused even before the poll comes round to it or the
        worker's word comes (paced, shared among the rooms: :class:`~server.look_shares.LookShares`; where no turn
        comes within :data:`TOKEN_LOOK_WAIT`, or the list fails, nobody is returned and the record decides). Looked into, the answer is a look like the poll's, taken into the record;
        handed over, the record's count is the worker's and the answer goes nowhere else (it has no place in the
        order of the worker's joins and leaves: one asked before a leave and answered after it would put the
        departed back). Bounded by the transport's timeout."""
        if not self._book.check(record.session_id):
            return frozenset()
        return await self._token_looks.look(record.session_id, lambda: self._checked(record)) or frozenset()

    async def _checked(self, record: SessionRecord) -> frozenset[str]:
        """A token check's list, once its turn came: the table says again whether the room is listed (the session
        may have been handed over, or ended, while the check waited)."""
        if not self._book.check(record.session_id):
            return frozenset()
        if self._book.looks_into(record.session_id):
            return await self._look(record)
        return await self._listed(record) or frozenset()

    async def run(self) -> None:
        """The poll (LiveKit; where rooms are watched, or not seen at all, it returns at once): each followed room in
        turn, paced by :data:`LOOKS_PER_SECOND` and :data:`LOOK_PERIOD`, and the token checks' turns, until cancelled."""
        if self._list is None:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._token_looks.run)  # the token checks' turns
            await self._poll()

    async def _poll(self) -> None:
        assert self._list is not None
        while True:
            looked = [self._records[session_id] for session_id in self._book.looked_into()]
            if not looked:
                self._more = trio.Event()
                await self._more.wait()
                continue
            round_at = trio.current_time()
            for record in looked:
                look_at = trio.current_time()
                await self._look(record)
                await trio.sleep_until(look_at + 1 / LOOKS_PER_SECOND)
            await trio.sleep_until(round_at + LOOK_PERIOD)

    async def _look(self, record: SessionRecord) -> frozenset[str]:
        """One RoomService list (bounded by the transport's timeout) into the record, unless the session was handed
        over or ended meanwhile (or a newer look's answer was taken); who it saw is returned either way (nobody
        where it failed: logged, paced, the record left as it was)."""
        if not self._looks_into(record):
            return frozenset()
        ticket = next(self._tickets)
        looks = self._under_way.setdefault(record.session_id, _Looks())
        looks.under_way += 1
        try:
            present = await self._listed(record)
        finally:
            looks.under_way -= 1
            if not looks.under_way:  # a later look is later than every ticket before it: nothing to keep
                del self._under_way[record.session_id]
        if present is None:
            return frozenset()
        if ticket < looks.newest:
            return present  # a look asked for after this one answered first: this answer is older than the record's
        looks.newest = ticket
        if self._looks_into(record) and self._book.take_look(record.session_id):
            moved(record, present)
        return present

    async def _listed(self, record: SessionRecord) -> frozenset[str] | None:
        """Who the RoomService lists in the session's room (bounded by the transport's timeout), or None where the
        list failed (logged, paced)."""
        assert self._list is not None
        try:
            return await self._list(record.room)
        except TransportError as exc:
            self._failures.warning("session %s: %s", record.session_id, exc)
            return None

    def _looks_into(self, record: SessionRecord) -> bool:
        """Whether this record's room is looked into now (not handed over or ended; the record is the session's)."""
        return self._records.get(record.session_id) is record and self._book.looks_into(record.session_id)


class _Looks:
    """The looks under way into one session's room (a token's and the poll's may overlap), and the newest of them
    whose answer was taken. Answers come in any order when LiveKit is slow: the last to come used to win, so a
    token's look that asked before the controller joined, answering after the poll had seen it, counted nobody, and a
    token for an identity in the room was granted on that view (LiveKit then drops the holder). An answer older than
    the one taken is dropped. Kept only while a look is under way: a new look's ticket is later than any before."""

    __slots__ = ("newest", "under_way")

    def __init__(self) -> None:
        self.under_way, self.newest = 0, -1


def moved(record: SessionRecord, present: frozenset[str]) -> None:
    """The room says who is in it now: the record counts them, its worker left out (an ended session nobody)."""
    if record.is_terminal:
        return
    worker = None if record.worker_id is None else worker_participant(record.worker_id)
    record.participants = set(present - {worker})

"""A session's viewer seats: what viewers may make the server hold for one session now, at most
:data:`MAX_VIEWERS_PER_SESSION`.

A seat is taken by a viewer in the session's room, or by a viewer token handed out that can still be used: not
expired and not yet used to join (a *pass*, kept on the record until then). A token is used at the room's door,
which spends its pass; once its viewer leaves, the seat is free. The token still opens the room until it expires,
but it holds no seat while its viewer is away: kept until then, a seat would stay taken for up to the token's
lifetime (``--token-ttl``, an hour by default) for someone who may never come back, and new viewers would be turned
away from an empty room. A viewer coming back takes a free seat at the door, and is refused ``viewer_limit`` there
when there is none (local rooms), so the room never holds more viewers than the limit, and a token handed out
unused always finds its seat. The seats were counted per identity a token was ever made for, and a long session
turned away its 33rd distinct viewer for good, its room empty.

What the server remembers stays bounded: passes are the only identities kept, at most the limit per session, and
each goes when its token is used or expires. On LiveKit the door is LiveKit's, which lets a viewer that left back in
with its still-valid token whatever the seats; so the session's worker asks at each join whether the joiner holds a
seat (:func:`over_seats`, the door's own rule, which spends the joiner's pass as the door does) and, if not,
removes it through the RoomService (the newest joiner; never the controller or the server's own participants). For
a session on a worker agent the authority does both, from the agent's reports of its room
(:mod:`server.cluster.seat_reports`): the agent holds no API key and none of the passes. A
session's LiveKit room held far more than 32 viewers (tokens handed out while seats were free, then all used at
once), and nothing sent any away; and a pass was spent only at a later token request that still saw its viewer in
the room, so a viewer that came and went before it held its seat until its token expired. A viewer that comes and
goes while no worker is in the room (a queued session's) is seen only by the server's looks (a token check's, the
poll's), and one unseen holds its seat until its token expires, never less; a queued room over its seats is brought
back to them when its worker joins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from .reasons import echo
from .runtime_errors import SessionConflict, ViewerLimit
from .tokens import SERVER_IDENTITY_PREFIX
from .transport import TransportError

if TYPE_CHECKING:
    from .registry import SessionRecord

__all__ = ["MAX_VIEWERS_PER_SESSION", "SEND_AWAY_WAITS", "SendsAway", "ViewerPasses", "ViewerSeats", "over_seats", "send_away_over_seats"]

log = logging.getLogger("chunkline.rooms")

#: viewer seats one session has: viewers in its room and viewer tokens handed out not yet used (one socket each)
MAX_VIEWERS_PER_SESSION = 32

#: seconds between tries at sending a viewer over the seats away (LiveKit refused, or did not answer in time)
SEND_AWAY_WAITS = (1.0, 2.0, 4.0)


@attrs.define
class ViewerPasses:
    """A session's viewer tokens handed out and not yet used to join: identity -> when its newest one expires
    (trio clock). A fresh token for an identity replaces its pass."""

    until: dict[str, float] = attrs.Factory(dict)

    def open(self, now: float) -> dict[str, float]:
        """The passes that can still be used (the expired ones are forgotten)."""
        for identity in [identity for identity, until in self.until.items() if until <= now]:
            del self.until[identity]
        return self.until

    def spend(self, identities: frozenset[str] | set[str]) -> None:
        """These viewers are in the room: their tokens have been used."""
        for identity in identities:
            self.until.pop(identity, None)


class ViewerSeats:
    """Counts and hands out one server's viewer seats: a token request takes one (:meth:`hand_out`), a local room's
    door checks and spends one (:meth:`door`)."""

    def __init__(self, ttl_seconds: float, find_room: Callable[[str], SessionRecord | None]) -> None:
        self.ttl_seconds = ttl_seconds  # a pass lasts as long as the token it stands for
        self.find_room = find_room  # the live record whose room this is

    def hand_out(self, record: SessionRecord, identity: str, present: frozenset[str] = frozenset()) -> None:
        """A viewer token for ``identity`` is about to be made: refused (SessionConflict) for an identity in use,
        (ViewerLimit) when every seat is taken; else its pass is kept until the token expires."""
        now = trio.current_time()
        if identity == record.controller_identity:
            raise SessionConflict(f"identity {echo(identity)} is already used in this room")
        in_room = viewers(record, present)
        record.viewer_passes.spend(in_room)
        if identity in in_room:
            raise SessionConflict(f"viewer {echo(identity)} is already in the room")
        full = self.full(record, in_room, identity, now)
        if full is not None:
            raise ViewerLimit(f"session {record.session_id}: {full}")
        record.viewer_passes.until[identity] = now + self.ttl_seconds

    def door(self, room: str, identity: str, take: bool) -> str | None:
        """Why a viewer of ``identity`` may not join ``room`` now (None: it may). With ``take`` it joins: its pass,
        if it had one, is spent."""
        record = self.find_room(room)
        if record is None or record.is_terminal:
            return None  # the room's own check refuses it (session_closed)
        return seat_refusal(record, identity, take)

    @staticmethod
    def full(record: SessionRecord, in_room: frozenset[str], identity: str, now: float) -> str | None:
        """What fills the session's seats, in words, when ``identity`` cannot have one (its own pass is its seat)."""
        passes = record.viewer_passes.open(now)
        unused = [until for holder, until in passes.items() if holder != identity and holder not in in_room]
        if len(in_room) + len(unused) < MAX_VIEWERS_PER_SESSION:
            return None
        expiry = f" (the first expires in {min(unused) - now:.0f} s)" if unused else ""
        return (f"all {MAX_VIEWERS_PER_SESSION} viewer seats are taken: {len(in_room)} viewer(s) in the room and "
                f"{len(unused)} viewer token(s) handed out and not used yet{expiry}; a seat frees when a viewer "
                f"leaves or an unused token expires")


def viewers(record: SessionRecord, present: frozenset[str] = frozenset()) -> frozenset[str]:
    """The viewers in the session's room: everyone there but its controller and the server's own participants
    (``present``: who a look into the room saw besides the record's count)."""
    return frozenset(identity for identity in record.participants | present
                     if identity != record.controller_identity
                     and not identity.lower().startswith(SERVER_IDENTITY_PREFIX))


def seat_refusal(record: SessionRecord, identity: str, take: bool) -> str | None:
    """Why the viewer ``identity`` holds no seat of the session now, in words (None: it holds one; with ``take``
    it joins, and its pass, if it had one, is spent)."""
    full = ViewerSeats.full(record, viewers(record) - {identity}, identity, trio.current_time())
    if full is None and take:
        record.viewer_passes.spend({identity})
    return full


class SendsAway(Protocol):
    """What can send a participant out of a room (a :class:`RoomConnection`'s ``send_away``)."""

    async def send_away(self, identity: str, reason: str, detail: str) -> None: ...


def over_seats(record: SessionRecord, identity: str) -> str | None:
    """Why ``identity``, who just joined the session's room, holds no viewer seat (None: it holds one, or it is no
    viewer: the controller, the server's own participants; a viewer is known by its identity, as LiveKit shows it).
    The room's worker asks at each join where the door is LiveKit's, which lets a viewer that left back in with its
    still-valid token whatever the seats (a local room's door holds them, by the token's role)."""
    if record.is_terminal or identity not in viewers(record, frozenset({identity})):
        return None
    return seat_refusal(record, identity, take=True)


async def send_away_over_seats(connection: SendsAway, session_id: str, identity: str, why: str) -> None:
    """The room's worker (or, for an agent's session, the authority: :mod:`server.cluster.seat_reports`) sends away a
    viewer that joined over the seats (the newest joiner), in one line of the log naming session and identity. A
    removal LiveKit refuses or does not answer is tried again after each of :data:`SEND_AWAY_WAITS` (the viewer
    stayed for good after one failure: nothing else looks at it again); past them the viewer stays, logged."""
    log.warning("session %s: viewer %r joined over the %d viewer seats and is sent away", session_id, identity,
                MAX_VIEWERS_PER_SESSION)
    for wait in (*SEND_AWAY_WAITS, None):
        try:
            await connection.send_away(identity, "viewer_limit", why)
            return
        except TransportError as exc:
            if wait is None:
                log.warning("session %s: viewer %r over the seats stays in the room (%d tries): %s", session_id,
                            identity, len(SEND_AWAY_WAITS) + 1, exc)
                return
            log.info("session %s: sending viewer %r away failed, tried again in %g s: %s", session_id, identity,
                     wait, exc)
            await trio.sleep(wait)

"""Data messages from a LiveKit participant the worker's room has not heard of yet, held until it has.

LiveKit forwards a participant's data at once but tells the others of its join a moment later (more than a second
on a busy server), and the SDK names a message's sender from the room's roster: a message from a participant not
in it yet comes with no sender at all (the native event's identity is empty too). A controller's first controls,
sent as it joined a room the worker was already in, were refused as not the controller's and answered to nobody:
its initial key state was lost.

So such a message waits (:class:`SendersToCome`) until the room hears of a participant that may publish data, who
sent it: in a session's room the tokens let only the controller and the server's own participants publish data (a
viewer's grant forbids it, and LiveKit drops what it sends), and the server's participants never send controls.
Messages that wait longer than :data:`SENDER_WAIT`, or past :data:`HELD_MOST` of them, go on with no sender, refused
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import DataReceived

__all__ = ["HELD_MOST", "SENDER_WAIT", "SendersToCome"]

SENDER_WAIT = 10.0  # seconds a message from an unheard-of sender waits for the room to hear of it
HELD_MOST = 64  # messages that wait so at once (the runner holds 64 controls before a session exists too)


class SendersToCome:
    """Messages whose sender the room has not heard of, in arrival order, until a participant that may send data
    joins (:meth:`heard_of`): they are its messages, handed on in order, named."""

    def __init__(self, hand_on: Callable[[DataReceived], None], call_later: Callable[..., Any],
                 wait: float = SENDER_WAIT, most: int = HELD_MOST) -> None:
        self._hand_on = hand_on
        self._call_later = call_later
        self._wait = wait
        self._most = most
        self._held: list[tuple[str, bytes]] = []  # (topic, payload)
        self._give_up_at: Any = None  # the timer that hands them on unnamed

    def hold(self, topic: str, payload: bytes) -> None:
        """A message with no sender the room knows: wait for one (past :data:`HELD_MOST` waiting, on unnamed)."""
        if len(self._held) >= self._most:
            self._hand_on(DataReceived(topic, payload, None))
            return
        self._held.append((topic, payload))
        if self._give_up_at is None:
            self._give_up_at = self._call_later(self._wait, self._hand_on_unnamed)

    def heard_of(self, identity: str, may_send_data: bool) -> None:
        """The room heard of a participant: one that may send data sent what waits."""
        if not self._held or not may_send_data:
            return
        held = self._take()
        for topic, payload in held:
            self._hand_on(DataReceived(topic, payload, identity))

    def close(self) -> None:
        self._take()

    def _hand_on_unnamed(self) -> None:
        self._give_up_at = None
        for topic, payload in self._take():
            self._hand_on(DataReceived(topic, payload, None))

    def _take(self) -> list[tuple[str, bytes]]:
        held, self._held = self._held, []
        if self._give_up_at is not None:
            self._give_up_at.cancel()
            self._give_up_at = None
        return held

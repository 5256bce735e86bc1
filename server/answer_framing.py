"""The backend side of one spliced connection: where each of hypercorn's answers ends.

The front passes a client's requests on to hypercorn and its answers back. A client done sending (it shut its
write side, as a one-shot client does after reading its answer) is owed nothing more once every request it sent
has had its whole answer; hypercorn, which is never told of that end (it takes an end of input for a client gone,
and may drop an answer it is still writing), kept the connection until its keep-alive timeout, 5 s. Those
connections counted towards the front's 1,024: about 200 one-shot requests a second turned every other client
away. :class:`AnswerFraming` follows the answers with h11, as a client would, told of each request only by its
method (where an answer ends does not depend on the request's body, but a HEAD's answer has none), so the front
can close such a connection the moment it owes nothing.
"""

from __future__ import annotations

from collections import deque

import h11

__all__ = ["AnswerFraming"]


class AnswerFraming:
    """Which of the requests passed on to the backend still await the whole of their answer."""

    def __init__(self) -> None:
        self._h11 = h11.Connection(h11.CLIENT)
        self._waiting: deque[bytes] = deque()  # the methods of requests passed on whose answer has not begun
        self._answering = False  # an answer's request was told to h11, and its end has not come
        self._begun = False  # a byte of the answer under way came
        #: h11 could not follow an answer (or the connection left HTTP/1.1): nothing is known of what is owed
        self.lost_track = False

    @property
    def settled(self) -> bool:
        """Every request passed on has had its whole answer (nothing is owed, nothing is under way)."""
        return not (self.lost_track or self._answering or self._waiting)

    @property
    def unbegun(self) -> int | None:
        """How many requests passed on have had no byte of their answer yet; None once one has had part of its answer
        (nothing can be answered after it but the rest of it) or h11 lost track."""
        if self.lost_track or self._answering and self._begun:
            return None
        return len(self._waiting) + self._answering

    def passed(self, method: bytes) -> None:
        """A request (its method) goes whole to the backend, after those before it."""
        self._waiting.append(method)
        self._follow()

    def answered(self, data: bytes) -> None:
        """``data`` came from the backend, as it is relayed to the client."""
        if self.lost_track:
            return
        self._begun = self._begun or bool(data)
        try:
            self._h11.receive_data(data)
        except RuntimeError:  # data after the answer that ends the connection: nothing follows it
            self.lost_track = True
            return
        self._follow()

    def _follow(self) -> None:
        """Take h11 through what it holds: each answer's end starts the next request's cycle."""
        connection = self._h11
        try:
            while True:
                if not self._answering:
                    if not self._waiting or connection.our_state is not h11.IDLE:
                        return
                    method = self._waiting.popleft()
                    connection.send(h11.Request(method=method, target="/", headers=[("Host", "front")]))
                    connection.send(h11.EndOfMessage())
                    self._answering = True
                    self._begun = bool(connection.trailing_data[0])  # what came after the last answer's end
                event = connection.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if isinstance(event, h11.EndOfMessage):
                    self._answering = False
                    if connection.our_state is h11.DONE and connection.their_state is h11.DONE:
                        connection.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    self.lost_track = True
                    return
        except h11.ProtocolError:  # an answer h11 cannot follow (or a 101: another protocol from here on)
            self.lost_track = True

"""Where each request on a spliced HTTP/1.1 connection starts and ends, so the front can bound every one.

The front reads a connection's first head itself; later heads on a keep-alive connection and every body
pass through to hypercorn, which has no deadline for either. :class:`RequestFraming` follows the client's
bytes (pure: no I/O, ``now`` is an argument) and says by when the request under way must have arrived:
a head within ``head_seconds`` of its first byte, a body of ``n`` bytes within ``head_seconds + n /
MIN_UPLOAD_RATE`` of the end of its head. Between requests nothing is due (the idle deadline applies).

What cannot be framed is refused rather than passed on unbounded: a head over ``MAX_HEAD`` (431), a
``Transfer-Encoding`` body (411: send ``Content-Length``), a malformed or contradictory ``Content-Length``
(400), HTTP/2 without TLS (505) and a WebSocket upgrade after the connection's first request (400: the
front serves a room's socket itself, with its bounds, only when the upgrade opens the connection; a later one
reached hypercorn's WebSocket, which has none). A head goes on to hypercorn once it is whole, without any
``Upgrade``/``HTTP2-Settings`` field: hypercorn would switch an ``Upgrade: h2c`` request to HTTP/2, whose
streams the front cannot frame (any number of requests and bodies at once on one connection, past the
connection cap and the body budget); without the field the request is answered in HTTP/1.1, as the upgrade
allows. Once the backend switches protocols (101) anyway, the connection is passed through as it is
(:meth:`switched`).

The bodies of all connections together are bounded too (:class:`BodyBudget`): the app holds a body in memory
while it arrives, so a body's ``Content-Length`` (up to the largest body the app takes) is reserved when its
head has arrived and given back once the body has passed, or its connection ended. A head whose body would
take the total past the budget is answered 503 with ``Retry-After`` before any of it reaches the app.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["BODY_RETRY_AFTER", "MIN_UPLOAD_RATE", "BodyBudget", "FramingRefused", "RequestFraming"]

MIN_UPLOAD_RATE: Final = 16384  # bytes a second a request body must at least arrive at
BODY_RETRY_AFTER: Final = 5  # seconds a client refused for the body budget is told to wait


class FramingRefused(Exception):
    """A request the front answers itself (``status``) and then closes the connection."""

    def __init__(self, status: int, detail: str, *, error: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.error = error  # the JSON body's ``error`` code; None: named after the status
        self.retry_after = retry_after


class BodyBudget:
    """The request body bytes every connection of the front together may have on their way in at once."""

    def __init__(self, limit: int, *, max_body: int) -> None:
        if limit < max_body:
            raise ValueError(f"a body budget of {limit} bytes could never take a body of {max_body} bytes")
        self.limit = limit
        self.max_body = max_body  # the app refuses a longer body (413) without reading it, so no more is held
        self.in_flight = 0
        self.refused = 0

    def take(self, length: int) -> int:
        """Reserve room for a body of ``length`` bytes; returns what was reserved. Raises FramingRefused (503)."""
        held = min(length, self.max_body)
        if self.in_flight + held > self.limit:
            self.refused += 1
            raise FramingRefused(
                503,
                f"the server is receiving too many request bodies at once ({self.in_flight} of {self.limit} bytes "
                f"in flight; this one declares {length}); retry in {BODY_RETRY_AFTER} s",
                error="bodies_in_flight",
                retry_after=BODY_RETRY_AFTER,
            )
        self.in_flight += held
        return held

    def give_back(self, held: int) -> None:
        self.in_flight -= held


class RequestFraming:
    """The client side of one spliced connection: heads and ``Content-Length`` bodies, in order."""

    def __init__(self, *, head_seconds: float, max_head: int, budget: BodyBudget | None = None) -> None:
        self._head_seconds = head_seconds
        self._max_head = max_head
        self._budget = budget
        self._held = 0  # what the body under way holds of the budget
        self._head = bytearray()  # the head under way
        self._body_left = 0
        self._passthrough = False
        #: when the request under way must have arrived (``math.inf``: none is under way)
        self.due = math.inf

    @property
    def body_left(self) -> int:
        """Bytes the body under way declares that have not arrived yet (at most; 0: none is under way)."""
        return self._body_left

    def switched(self) -> None:
        """The backend answered 101: what follows is another protocol, passed through as it is."""
        self._passthrough = True
        self.due = math.inf
        self.release()

    def release(self) -> None:
        """Give back what the body under way holds of the budget (it has passed, or the connection ended)."""
        if self._budget is not None and self._held:
            self._budget.give_back(self._held)
        self._held = 0

    def feed(self, data: bytes, now: float) -> bytes:
        """Follow ``data`` from the client; returns what of it goes on to the backend now (a head only once it is
        whole, as :meth:`_forwarded_head` leaves it). Raises :class:`FramingRefused` for what cannot be framed."""
        view = memoryview(data)
        forward = bytearray()
        while view:
            if self._passthrough:
                forward += view
                break
            if self._body_left:
                taken = min(self._body_left, len(view))
                self._body_left -= taken
                forward += view[:taken]
                view = view[taken:]
                if not self._body_left:
                    self.due = math.inf
                    self.release()
                continue
            if not self._head:
                self.due = now + self._head_seconds  # a new head: it must be whole in time
            start = max(0, len(self._head) - 3)
            self._head += view
            end = self._head.find(b"\r\n\r\n", start)
            if end < 0:
                if len(self._head) > self._max_head:
                    raise FramingRefused(431, "the request head is larger than the front allows")
                break
            if end > self._max_head:
                raise FramingRefused(431, "the request head is larger than the front allows")
            rest = bytes(self._head[end + 4:])
            head = bytes(self._head[:end])
            length = self._body_length(head)
            forward += self._forwarded_head(head) + b"\r\n\r\n"
            self._head.clear()
            self._body_left = length  # also what is still to come if the budget refuses it
            if length and self._budget is not None:
                self._held = self._budget.take(length)
            self.due = now + self._head_seconds + length / MIN_UPLOAD_RATE if length else math.inf
            view = memoryview(rest)
        return bytes(forward)

    @staticmethod
    def _forwarded_head(head: bytes) -> bytes:
        """``head`` without the fields that ask to leave HTTP/1.1 (``Upgrade``, ``HTTP2-Settings``); a WebSocket
        upgrade here is refused (the front serves only one that opens its connection)."""
        line, _, fields = head.partition(b"\r\n")
        kept = [line]
        for field in fields.split(b"\r\n") if fields else []:
            name = field.partition(b":")[0].strip().lower()
            if name == b"upgrade" and b"websocket" in field.lower():
                raise FramingRefused(400, "a WebSocket upgrade must be the first request on its connection "
                                          "(open a new connection for it)", error="websocket_not_first")
            if name not in (b"upgrade", b"http2-settings"):
                kept.append(field)
        return b"\r\n".join(kept)

    @staticmethod
    def _body_length(head: bytes) -> int:
        line, _, fields = head.partition(b"\r\n")
        if line.startswith(b"PRI * HTTP/2.0"):
            raise FramingRefused(505, "HTTP/2 needs TLS here; speak HTTP/1.1")
        lengths: set[bytes] = set()
        for field in fields.split(b"\r\n"):
            name, _, value = field.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                raise FramingRefused(411, "a request body needs Content-Length (Transfer-Encoding is not taken)")
            if name == b"content-length":
                lengths.update(part.strip() for part in value.split(b","))
        if not lengths:
            return 0
        if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
            raise FramingRefused(400, "Content-Length must be one decimal number")
        return int(lengths.pop())

"""Where each request on a spliced HTTP/1.1 connection starts and ends, so the front can bound every one.

The front reads a connection's first head itself; later heads on a keep-alive connection and every body
pass through to hypercorn, which has no deadline for either. :class:`RequestFraming` follows the client's
bytes (pure: no I/O, ``now`` is an argument) and says by when the request under way must have arrived:
a head within ``head_seconds`` of its first byte, a body of ``n`` bytes within ``head_seconds + n /
MIN_UPLOAD_RATE`` of the end of its head. Between requests nothing is due (the idle deadline applies).

Every head is read as hypercorn reads it, by h11 (:func:`parse_head_by_h11`), so the two never disagree
about one -- or, when it is plain (the common case, read by one regular expression: :mod:`server.plain_head`),
exactly as h11 would read it: a head ends where h11 ends it (a blank line; ``\\r\\n`` or bare ``\\n`` line
endings alike, :func:`head_end`), and a head h11 refuses -- two ``Host`` fields, none in HTTP/1.1, an HTTP/0.9 request
line, a NUL or a space in the target, a field line without a colon or with a space before it, a malformed
``Content-Length`` -- is refused here with a 400 ``malformed_request`` naming h11's reason (hypercorn
answered these with an empty 400). A connection whose first byte cannot begin a request line (a TLS
handshake on the plain port) is refused at once, as h11 does (:func:`not_a_request_line`).

What cannot be framed is refused rather than passed on unbounded: a head over ``MAX_HEAD`` (431), a
``Transfer-Encoding`` body (411: send ``Content-Length``), HTTP/2 without TLS (505) and a WebSocket upgrade
after the connection's first request (400: the front serves a room's socket itself, with its bounds, only
when the upgrade opens the connection; a later one reached hypercorn's WebSocket, which has none). A head
goes on to hypercorn once it is whole: a plain one as it came, any other as it was parsed and written again
with ``\\r\\n`` endings (so hypercorn reads exactly the head the front framed), without any ``Upgrade``/``HTTP2-Settings`` field:
hypercorn would switch an ``Upgrade: h2c`` request to HTTP/2, whose streams the front cannot frame (any
number of requests and bodies at once on one connection, past the connection cap and the body budget);
without the field the request is answered in HTTP/1.1, as the upgrade allows. Once the backend switches
protocols (101) anyway, the connection is passed through as it is (:meth:`switched`).

The bodies of all connections together are bounded too (:class:`BodyBudget`): the app holds a body in memory
while it arrives, so each body byte takes its room in the budget as it arrives (up to the largest body the app
takes), and the room goes back once the body has passed, or its connection ended. A head whose body would not
fit in what is left now is answered 503 with ``Retry-After`` before any of it reaches the app; a body that
outgrows the room left on its way (others arrived meanwhile) is cut with the same 503. Room is held for bytes
that came, never for a length a head declares: 16 connections that each declared 8 MiB and then sent a byte
now and then held the whole default budget, and every create was a 503. A body must also keep up
``MIN_UPLOAD_RATE`` from the end of its head on (after ``head_seconds`` of grace), not only arrive whole in
time: by the total alone, such a body could send nothing for minutes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Final

import attrs
import h11

from .plain_head import scan_plain_head
from .reasons import MAX_ECHO, cut

__all__ = [
    "longest_body_seconds",
    "BODY_RETRY_AFTER",
    "MIN_UPLOAD_RATE",
    "BodyBudget",
    "FramingRefused",
    "RequestFraming",
    "RequestHead",
    "head_end",
    "not_a_request_line",
    "parse_head",
    "parse_head_by_h11",
]

MIN_UPLOAD_RATE: Final = 16384  # bytes a second a request body must at least arrive at
BODY_RETRY_AFTER: Final = 5  # seconds a client refused for the body budget is told to wait
_BLANK_LINE: Final = re.compile(rb"\n\r?\n")  # h11's end of a head
_TE_HINT: Final = 501  # h11's status hint for a Transfer-Encoding it does not take
_TRANSFER_ENCODING: Final = "a request body needs Content-Length (Transfer-Encoding is not taken)"
_LEAVING_HTTP_1_1: Final = frozenset({b"upgrade", b"http2-settings"})


class FramingRefused(Exception):
    """A request the front answers itself (``status``) and then closes the connection."""

    def __init__(
        self, status: int, detail: str, *, error: str | None = None, retry_after: int | None = None, times: int = 1
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.error = error  # the JSON body's ``error`` code; None: named after the status
        self.retry_after = retry_after
        self.times = times  # the requests it answers (pipelined ones, each owed an answer of its own)


@attrs.frozen
class RequestHead:
    """A request head h11 accepted: its request line and its fields (names as sent, values as h11 left them);
    ``raw``: its bytes as sent, when they go on unchanged (a plain head, :mod:`server.plain_head`)."""

    method: bytes
    target: bytes
    version: bytes
    fields: tuple[tuple[bytes, bytes], ...]
    raw: bytes | None = attrs.field(default=None, eq=False, repr=False)

    def values(self, name: bytes) -> list[bytes]:
        """The values of every field called ``name`` (lower case)."""
        return [value for field, value in self.fields if field.lower() == name]

    @property
    def is_websocket_upgrade(self) -> bool:
        return any(b"websocket" in value.lower() for value in self.values(b"upgrade"))

    @property
    def ends_connection(self) -> bool:
        """Whether the connection closes after this request's answer: HTTP/1.0 (h11 keeps no 1.0 connection alive)
        or ``Connection: close``."""
        tokens = {token.strip().lower() for value in self.values(b"connection") for token in value.split(b",")}
        return self.version != b"1.1" or b"close" in tokens

    def encode(self, *, without: frozenset[bytes] = frozenset()) -> bytes:
        """The head written again (``\\r\\n`` endings, its blank line included), less the fields named in
        ``without`` (lower case)."""
        lines = [b"%s %s HTTP/%s" % (self.method, self.target, self.version)]
        lines += [name + b": " + value for name, value in self.fields if name.lower() not in without]
        return b"\r\n".join(lines) + b"\r\n\r\n"


def head_end(buffer: bytes | bytearray, start: int = 0) -> int:
    """Where the head in ``buffer`` ends (just past its blank line), searching from ``start``; -1: not yet."""
    match = _BLANK_LINE.search(buffer, max(0, start - 2))
    return -1 if match is None else match.end()


def not_a_request_line(buffer: bytes | bytearray) -> bool:
    """Whether ``buffer``'s first byte cannot begin a request line (h11 refuses such a connection at once)."""
    return bool(buffer) and buffer[0] < 0x21


def parse_head(raw: bytes) -> RequestHead:
    """The head ``raw`` (up to its :func:`head_end`) as h11 reads it: a plain one by :func:`scan_plain_head`
    (kept as sent), any other by :func:`parse_head_by_h11`, which raises :class:`FramingRefused`."""
    plain = scan_plain_head(raw)
    if plain is not None:
        return RequestHead(*plain, raw=raw)
    return parse_head_by_h11(raw)


def parse_head_by_h11(raw: bytes) -> RequestHead:
    """The head ``raw`` (up to its :func:`head_end`) read by h11. Raises :class:`FramingRefused`: 400 for a
    head h11 refuses, 411 for a ``Transfer-Encoding`` (the front frames ``Content-Length`` bodies only)."""
    if not_a_request_line(raw):
        raise FramingRefused(400, "malformed request head: illegal request line (it starts with a control "
                                  "character or a space)", error="malformed_request")
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=len(raw) + 1)
    connection.receive_data(raw)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError as exc:
        if exc.error_status_hint == _TE_HINT:
            raise FramingRefused(411, _TRANSFER_ENCODING) from None
        raise FramingRefused(400, f"malformed request head: {cut(str(exc), 2 * MAX_ECHO)}",
                             error="malformed_request") from None
    if not isinstance(event, h11.Request):  # raw ended before its blank line
        raise FramingRefused(400, "malformed request head: it ends before its blank line", error="malformed_request")
    head = RequestHead(event.method, event.target, event.http_version, tuple(event.headers.raw_items()))
    if head.values(b"transfer-encoding"):
        raise FramingRefused(411, _TRANSFER_ENCODING)
    return head


def longest_body_seconds(max_body: int, head_seconds: float) -> float:
    """How long the largest body the app takes may take at the minimum rate, after its head's ``head_seconds`` of
    grace (:class:`RequestFraming`'s rule): no deadline behind the front (Quart's own body timeout, 60 s by
    default) may cut a body that keeps it."""
    return head_seconds + max_body / MIN_UPLOAD_RATE


class BodyBudget:
    """The request body bytes every connection of the front together may have on their way in at once."""

    def __init__(self, limit: int, *, max_body: int) -> None:
        if limit < max_body:
            raise ValueError(f"a body budget of {limit} bytes could never take a body of {max_body} bytes")
        self.limit = limit
        self.max_body = max_body  # the app refuses a longer body (413) without reading it, so no more is held
        self.in_flight = 0
        self.refused = 0

    def check(self, length: int) -> None:
        """Whether a body of ``length`` bytes would fit now (nothing is reserved). Raises FramingRefused (503)."""
        if self.in_flight + min(length, self.max_body) > self.limit:
            raise self._refusal(f"this one declares {length}")

    def take(self, arrived: int) -> None:
        """Take room for ``arrived`` body bytes that came. Raises FramingRefused (503) when there is none."""
        if self.in_flight + arrived > self.limit:
            raise self._refusal("this one outgrew the room left on its way")
        self.in_flight += arrived

    def _refusal(self, which: str) -> FramingRefused:
        self.refused += 1
        return FramingRefused(
            503,
            f"the server is receiving too many request bodies at once ({self.in_flight} of {self.limit} bytes "
            f"in flight; {which}); retry in {BODY_RETRY_AFTER} s",
            error="bodies_in_flight",
            retry_after=BODY_RETRY_AFTER,
        )

    def give_back(self, held: int) -> None:
        self.in_flight -= held


class RequestFraming:
    """The client side of one spliced connection: heads and ``Content-Length`` bodies, in order."""

    def __init__(self, *, head_seconds: float, max_head: int, budget: BodyBudget | None = None,
                 on_passed: Callable[[bytes], None] | None = None) -> None:
        self._head_seconds = head_seconds
        self._max_head = max_head
        self._budget = budget
        self._held = 0  # what the body under way holds of the budget: the bytes of it that came (at most max_body)
        self._head = bytearray()  # the head under way
        self._body_left = 0
        self._body_due_from = 0.0  # when the body under way would be late with nothing of it arrived
        self._body_arrived = 0
        self._passthrough = False
        self._last = False  # the request under way (or the one that came) ends the connection
        self._on_passed = on_passed  # told each head's method as it is passed on (where its answer ends depends on it)
        #: a WebSocket upgrade that came after the connection's first request: its head and what followed it, for the
        #: front to serve as a room socket once every answer before it went out (None: none came)
        self.upgrade: bytes | None = None
        #: when the request under way must have arrived (``math.inf``: none is under way)
        self.due = math.inf

    @property
    def body_left(self) -> int:
        """Bytes the body under way declares that have not arrived yet (at most; 0: none is under way)."""
        return self._body_left

    @property
    def finished(self) -> bool:
        """Whether the connection's last request came whole (HTTP/1.0, ``Connection: close``): what the client sends
        after it is not passed on (hypercorn answered it with an empty 400 and closed, the first answer lost)."""
        return self.upgrade is not None or self._last and not self._body_left

    @property
    def between_requests(self) -> bool:
        """Whether every request that came so far is whole, head and body (none is under way): what is owed next is
        the backend's answer."""
        return not self._passthrough and not self._head and not self._body_left

    @property
    def head_under_way(self) -> bool:
        """Whether part of a request's head came, and so none of it was passed on yet."""
        return not self._passthrough and bool(self._head)

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
            if self.finished:
                break  # past the connection's last request: dropped, as the lingering close drops it
            if self._body_left:
                taken = min(self._body_left, len(view))
                if self._budget is not None and self._held < self._budget.max_body:
                    room = min(taken, self._budget.max_body - self._held)  # the app reads no more than max_body
                    self._budget.take(room)
                    self._held += room
                self._body_left -= taken
                self._body_arrived += taken
                forward += view[:taken]
                view = view[taken:]
                if not self._body_left:
                    self.due = math.inf
                    self.release()
                else:  # it keeps up the minimum rate: each byte buys time for the next
                    self.due = self._body_due_from + self._body_arrived / MIN_UPLOAD_RATE
                continue
            if not self._head:
                self.due = now + self._head_seconds  # a new head: it must be whole in time
            start = len(self._head)
            self._head += view
            end = head_end(self._head, start)
            if end < 0:
                if not_a_request_line(self._head):
                    parse_head(bytes(self._head))  # refused at once, as h11 refuses it
                if len(self._head) > self._max_head:
                    raise FramingRefused(431, "the request head is larger than the front allows")
                break
            if end > self._max_head + 4:
                raise FramingRefused(431, "the request head is larger than the front allows")
            head = parse_head(bytes(self._head[:end]))
            if head.is_websocket_upgrade:  # not hypercorn's: the front serves it, after the answers before it
                self.upgrade = bytes(self._head)
                self._head.clear()
                self.due = math.inf
                break
            rest = bytes(self._head[end:])
            length = self._body_length(head)
            forward += self._forwarded_head(head)
            if self._on_passed is not None:
                self._on_passed(head.method)
            self._last = head.ends_connection
            self._head.clear()
            self._body_left = length  # also what is still to come if the budget refuses it
            if length and self._budget is not None:
                self._budget.check(length)
            self._body_due_from = now + self._head_seconds
            self._body_arrived = 0
            self.due = self._body_due_from if length else math.inf
            view = memoryview(rest)
        return bytes(forward)

    @staticmethod
    def _forwarded_head(head: RequestHead) -> bytes:
        """``head`` as hypercorn gets it: a plain one as it came (it has none of the fields below), any other
        written again without the fields that ask to leave HTTP/1.1 (``Upgrade``, ``HTTP2-Settings``; a WebSocket
        upgrade never reaches hypercorn, whose WebSocket bounds neither messages nor writes nor pongs)."""
        return head.raw if head.raw is not None else head.encode(without=_LEAVING_HTTP_1_1)

    @staticmethod
    def _body_length(head: RequestHead) -> int:
        if head.method == b"PRI" and head.version == b"2.0":
            raise FramingRefused(505, "HTTP/2 needs TLS here; speak HTTP/1.1")
        lengths = head.values(b"content-length")  # h11 took at most one value (400 otherwise)
        return int(lengths[0]) if lengths else 0

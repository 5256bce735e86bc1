"""The authority <-> worker-agent wire: versioned attrs messages in length-prefixed JSON frames.

One TCP connection per agent (plain, or TLS when the authority has a certificate:
:func:`server.cluster.tls.wrap_client_tls` / ``wrap_server_tls`` put a ``trio.SSLStream`` under the
same framing). A frame is a 4-byte big-endian length and that many bytes of UTF-8
JSON: ``{"v": PROTOCOL, "type": "<name>", ...fields}``. Frames above
:data:`MAX_FRAME_BYTES` and unknown types, versions or fields are refused with a
:class:`WireError` that names what was wrong.

Handshake: the authority speaks first with :class:`Hello` (a fresh nonce); the agent
answers :class:`Register` with a fresh nonce of its own and a ``proof``, an HMAC-SHA256
under the cluster token over the authority's nonce and the worker id; the authority answers
:class:`Welcome`, :class:`Refused` (``transient`` or not) or :class:`Busy` (too many handshakes are
pending), the last two then closing, each with its own proof over both nonces, so the agent knows it
reached a holder of the token too (:mod:`server.cluster.proofs`). A Busy without a proof, or in place of
the Hello, proves nothing (the authority never sends one: past its places to answer Busy it closes unanswered).
The token itself never crosses the wire. From the frame after the Welcome on, every frame in either direction carries a
tag (:meth:`Channel.authenticate`): an HMAC under a key both derive from the token and the
nonces, over the frame's direction, its number and its bytes, so that nobody between the
two can send, change, replay, reorder or drop a frame unnoticed, TLS or not. After that the agent sends
:class:`Ready`, :class:`Heartbeat`, :class:`SessionEvent`, :class:`SessionFinished`,
:class:`Participants`, :class:`Failed`, :class:`OptionsChecked` and :class:`Goodbye`; the authority sends :class:`HeartbeatAck`,
:class:`Start`, :class:`Stop`, :class:`Drain`, :class:`CheckOptions`, and :class:`Goodbye` as it stops (its sessions
drained), the last frame before it closes: the agent dials again without counting that close as a failure.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import ssl
import struct
from typing import Any, ClassVar

import attrs
import trio

from ..json_limits import JsonRefused, loads as json_loads
from ..reasons import echo, echo_each
from .tls import ssl_detail
from .wire_values import (
    MAX_CAPACITY, capacity, device_indexes, drain_seconds, flag, identities, integer, label, node_name, obj, opt_image_size,
    opt_label, opt_text, plan, process_id, report, seconds, settings_taken, text, texts,
)

__all__ = [
    "PROTOCOL",
    "MAX_AGENT_FRAME_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_HANDSHAKE_FRAME_BYTES",
    "MAX_CAPACITY",
    "WireError",
    "ProtocolMismatch",
    "ConnectionClosed",
    "PeerStalled",
    "Channel",
    "Message",
    "Hello",
    "Busy",
    "Register",
    "Welcome",
    "Refused",
    "Ready",
    "Failed",
    "Heartbeat",
    "HeartbeatAck",
    "Start",
    "Stop",
    "Drain",
    "SessionEvent",
    "SessionFinished",
    "Participants",
    "CheckOptions",
    "OptionsChecked",
    "Goodbye",
    "body_of",
    "encode",
    "decode",
]

#: 3: ready.offered_taken, refused.transient, a busy that answers the register with its proof; 4: ready.settings_taken
#: (the offered settings the pipeline took with their values, in place of offered_taken's names); 6: participants;
#: 7: ready.takes_prompt and ready.takes_image; 8: the authority's goodbye as it stops; 9: the authority sends away
#: a viewer its agent reports in a LiveKit room over the session's seats (the agent's runner checks no seats); 10:
#: ready.worker_mode (the agent's own, which metadata shows: it showed the authority's); 11: check_options.image_size
#: and options_checked.image_refused (the pipeline's check_image of a create's image, in the same round trip)
PROTOCOL = 11
MAX_FRAME_BYTES = 16 * 1024 * 1024  # a Start may carry an uploaded image (bounded by the API's body limit)
#: the largest frame a peer may send before it proved the token (a Register is well under 1 KiB)
MAX_HANDSHAKE_FRAME_BYTES = 64 * 1024
#: the largest frame an agent may send once it proved the token: what it sends (heartbeats, session events, a Ready's
#: three reports of at most 64 KiB each) is far smaller than a Start's image; 16 MiB frames from one agent took the
#: authority's event loop 2-3 s each to parse, and its other agents were cut off for late heartbeat answers
MAX_AGENT_FRAME_BYTES = 1024 * 1024
MAX_JSON_DEPTH = 64  # a Start's config is at most the API's depth (32) inside the message
#: values a frame may hold: a Ready's three 64 KiB reports could hold about 100,000; a Start's image is one string
MAX_JSON_VALUES = 150_000
_HEADER = struct.Struct(">I")
TAG_BYTES = 32  # an HMAC-SHA256 tag after the body of every frame past the handshake
#: seconds a peer has to take a frame, by default, plus one second per :data:`MIN_SEND_RATE` bytes of it
SEND_TIMEOUT = 10.0
MIN_SEND_RATE = 1 << 20  # bytes per second: a peer slower than 8 Mbit/s at taking a large frame has stopped reading


class WireError(ValueError):
    """A frame or message that breaks the protocol; the connection is closed with this reason."""


class ProtocolMismatch(WireError):
    """A frame of another protocol version: the peer runs another chunkline (it will not change by dialing again)."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


class PeerStalled(ConnectionClosed):
    """The peer did not take a frame within its send deadline: it stopped reading (its host or event loop stalled),
    which is not the same as a connection that ended."""


class TlsFailed(ConnectionClosed):
    """TLS failed on the connection: the peer speaks no TLS there (another port, another protocol), or its
    certificate is not trusted (``untrusted``: another CA, expired, another name)."""

    def __init__(self, message: str, *, untrusted: bool) -> None:
        super().__init__(message)
        self.untrusted = untrusted


def _broken(what: str, exc: BaseException) -> ConnectionClosed:
    """The error for a stream that broke while ``what``. trio's BrokenResourceError says nothing itself: what
    broke it (an ssl or OS error) is its cause, and that is what the message names."""
    cause = exc.__cause__ if not str(exc) and exc.__cause__ is not None else exc
    detail = ssl_detail(cause)
    # an EOF in the handshake is a peer that closed (one turning connections away), not a TLS mismatch
    if isinstance(cause, ssl.SSLError) and not isinstance(cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        untrusted = isinstance(cause, ssl.SSLCertVerificationError)
        return TlsFailed(f"{what}: TLS failed: {detail}", untrusted=untrusted)
    return ConnectionClosed(f"{what}: {detail}")


_REGISTRY: dict[str, type[Message]] = {}


@attrs.frozen
class Message:
    """Base of every message; subclasses name their ``TYPE``."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            _REGISTRY[cls.TYPE] = cls


@attrs.frozen
class Hello(Message):
    TYPE = "hello"
    nonce: str = attrs.field(converter=text)
    authority_version: str = attrs.field(converter=text)


@attrs.frozen
class Busy(Message):
    """The answer to a Register when the authority has as many handshakes pending as it allows (someone may
    be flooding its port): dial again later. Its ``proof`` (:func:`~server.cluster.proofs.busy_proof`) is what
    lets an agent wait it out uncounted; one without (anyone can send that) counts as a failed connect."""

    TYPE = "busy"
    reason: str = attrs.field(converter=text)
    proof: str | None = attrs.field(default=None, converter=opt_text)


@attrs.frozen
class Register(Message):
    TYPE = "register"
    worker_id: str = attrs.field(converter=text)
    agent_nonce: str = attrs.field(converter=text)  # the authority proves the token over it (its Welcome)
    proof: str = attrs.field(converter=text)
    version: str = attrs.field(converter=text)
    pipeline: str = attrs.field(converter=text)  # the pipeline's name (file or package name)
    pipeline_digest: str = attrs.field(converter=text)
    node: str = attrs.field(converter=node_name)
    devices: tuple[int, ...] = attrs.field(converter=device_indexes)
    launcher: str = attrs.field(converter=label)
    pid: int = attrs.field(converter=process_id)
    slot: str | None = attrs.field(default=None, converter=opt_label)  # the launcher's slot, when it has one


@attrs.frozen
class Welcome(Message):
    TYPE = "welcome"
    worker_id: str = attrs.field(converter=text)
    heartbeat_interval: float = attrs.field(converter=seconds)
    deadline: float = attrs.field(converter=seconds)
    transport: str = attrs.field(converter=text)
    rooms_url: str | None = attrs.field(converter=opt_text)  # local rooms: the authority's HTTP base URL
    livekit_url: str | None = attrs.field(converter=opt_text)
    controller_timeout: float = attrs.field(converter=seconds)
    room_empty_timeout: float = attrs.field(converter=seconds)
    max_data_message_bytes: int = attrs.field(converter=integer)
    proof: str = attrs.field(converter=text)  # :func:`authority_proof`: the authority holds the cluster token


@attrs.frozen
class Refused(Message):
    TYPE = "refused"
    reason: str = attrs.field(converter=text)
    #: :func:`refusal_proof` when the authority answered a Register (an agent with another token cannot check it)
    proof: str | None = attrs.field(default=None, converter=opt_text)
    #: the same agent may be taken later (dial again, not counted toward giving up); False: it never will (exit 3)
    transient: bool = attrs.field(default=False, converter=flag)


@attrs.frozen
class Ready(Message):
    TYPE = "ready"
    capacity: int = attrs.field(converter=capacity)
    kind: str = attrs.field(converter=label)
    plan: dict[str, Any] = attrs.field(converter=plan)
    startup_check: dict[str, Any] = attrs.field(converter=report, factory=dict)  # the agent's: passed or skipped
    #: the offered settings the pipeline's ``get_service`` took, each with the value the agent gave it (what its
    #: sessions run with: an agent may be started with other values than the authority's); None: not known
    settings_taken: dict[str, Any] | None = attrs.field(default=None, converter=settings_taken)
    #: the session inputs the pipeline's service declares it takes (``pipelines.contract.inputs_taken``): the
    #: authority refuses a create that gives another
    takes_prompt: bool = attrs.field(default=True, converter=flag)
    takes_image: bool = attrs.field(default=True, converter=flag)
    #: the agent's own ``--worker-mode`` (an external agent's need not be the authority's); None: not said
    worker_mode: str | None = attrs.field(default=None, converter=opt_label)


@attrs.frozen
class Failed(Message):
    TYPE = "failed"
    reason: str = attrs.field(converter=text)


@attrs.frozen
class Heartbeat(Message):
    TYPE = "heartbeat"
    seq: int = attrs.field(converter=integer)
    sessions: tuple[str, ...] = attrs.field(converter=texts)


@attrs.frozen
class HeartbeatAck(Message):
    TYPE = "heartbeat_ack"
    seq: int = attrs.field(converter=integer)


@attrs.frozen
class Start(Message):
    TYPE = "start"
    session_id: str = attrs.field(converter=text)
    room: str = attrs.field(converter=text)
    identity: str = attrs.field(converter=text)  # the worker's participant identity in the room
    token: str = attrs.field(converter=text)  # minted by the authority for that identity and room
    controller_identity: str = attrs.field(converter=text)
    prompt: str | None = attrs.field(converter=opt_text)
    config: dict[str, Any] = attrs.field(converter=obj)
    image: str | None = attrs.field(converter=opt_text)  # base64 of the reference image, if any
    image_suffix: str | None = attrs.field(default=None, converter=opt_text)


@attrs.frozen
class Stop(Message):
    TYPE = "stop"
    session_id: str = attrs.field(converter=text)
    cause: str = attrs.field(converter=text)
    now: bool = attrs.field(default=False, converter=flag)  # cancel waiting at once (cleanup still runs)


@attrs.frozen
class Drain(Message):
    TYPE = "drain"
    deadline: float = attrs.field(converter=drain_seconds)  # seconds live sessions may take to finish (an hour at most)


@attrs.frozen
class SessionEvent(Message):
    """A stream-session table event the agent's runner applied; the authority applies its progress the same, and a
    drain with the cause (and the cause in words) it carries."""

    TYPE = "session_event"
    session_id: str = attrs.field(converter=text)
    seq: int = attrs.field(converter=integer)
    event: str = attrs.field(converter=text)
    error: str | None = attrs.field(default=None, converter=opt_text)
    pipeline_session_id: str | None = attrs.field(default=None, converter=opt_text)
    participants: tuple[str, ...] = attrs.field(default=(), converter=identities)
    drain_cause: str | None = attrs.field(default=None, converter=opt_text)
    drain_detail: str | None = attrs.field(default=None, converter=opt_text)


@attrs.frozen
class SessionFinished(Message):
    TYPE = "session_finished"
    session_id: str = attrs.field(converter=text)
    seq: int = attrs.field(converter=integer)
    error: str | None = attrs.field(converter=opt_text)
    drain_cause: str | None = attrs.field(converter=opt_text)
    told_room: bool = attrs.field(default=False, converter=flag)  # the runner told its room how it ended


@attrs.frozen
class Participants(Message):
    """Who is in a running session's room now (the agent's worker left out), sent when that changes: at most one
    a session every ``agent_sessions.PARTICIPANTS_EVERY`` seconds, the room as it stands then. Numbered with the
    session's events (a late one is dropped); where the rooms are the authority's own it reads them itself."""

    TYPE = "participants"
    session_id: str = attrs.field(converter=text)
    seq: int = attrs.field(converter=integer)
    participants: tuple[str, ...] = attrs.field(converter=identities)


@attrs.frozen
class CheckOptions(Message):
    """Check a create's session options, and its image's ``image_size`` (width, height) if it gives one, with the agent's
    pipeline (the create waits for the answer)."""

    TYPE = "check_options"
    check_id: int = attrs.field(converter=integer)
    options: dict[str, Any] = attrs.field(converter=obj)
    image_size: tuple[int, int] | None = attrs.field(default=None, converter=opt_image_size)


@attrs.frozen
class OptionsChecked(Message):
    """The answer: ``refused`` is the pipeline's reason for refusing the options, ``image_refused`` the image, ``error``
    why it could not check; all None: accepted."""

    TYPE = "options_checked"
    check_id: int = attrs.field(converter=integer)
    refused: str | None = attrs.field(default=None, converter=opt_text)
    error: str | None = attrs.field(default=None, converter=opt_text)
    image_refused: str | None = attrs.field(default=None, converter=opt_text)


@attrs.frozen
class Goodbye(Message):
    """The agent's, once its drain ran its course; the authority's, as it stops (its sessions drained)."""

    TYPE = "goodbye"
    reason: str = attrs.field(converter=text)


def body_of(message: Message) -> bytes:
    """A message's frame body (its JSON, no header, no tag)."""
    body = {"v": PROTOCOL, "type": message.TYPE, **attrs.asdict(message, recurse=False)}
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"a {message.TYPE} message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return data


def encode(message: Message) -> bytes:
    """A message as a handshake frame (untagged)."""
    data = body_of(message)
    return _HEADER.pack(len(data)) + data


def decode(data: bytes) -> Message:
    """One frame body to its message; :class:`WireError` names what is wrong."""
    try:
        body = json_loads(data, max_depth=MAX_JSON_DEPTH, max_values=MAX_JSON_VALUES)
    except JsonRefused as exc:
        raise WireError(f"a frame is not valid JSON: {exc.detail}") from None
    if not isinstance(body, dict):
        raise WireError("a frame must be a JSON object")
    version = body.pop("v", None)
    if version != PROTOCOL:
        raise ProtocolMismatch(f"protocol version {echo(version)} is not supported (this side speaks {PROTOCOL})")
    kind = body.pop("type", None)
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown message type {echo(kind)}")
    fields = attrs.fields(cls)
    unknown = sorted(set(body) - {f.name for f in fields})
    if unknown:
        raise WireError(f"{kind}: unknown field(s) {echo_each(unknown)}")
    missing = [f.name for f in fields if f.default is attrs.NOTHING and f.name not in body]
    if missing:
        raise WireError(f"{kind}: missing field(s) {', '.join(missing)}")
    for field in fields:  # each field's converter, so that the error names the field
        if field.name in body and field.converter is not None:
            try:
                body[field.name] = field.converter(body[field.name])  # type: ignore[operator]
            except TypeError as exc:
                detail = str(exc)
                joint = "" if detail.startswith(("[", ".")) else ": "
                raise WireError(f"{kind}.{field.name}{joint}{detail}") from None
    return cls(**body)


class Channel:
    """Framed messages over one byte stream; one sender at a time, one receiver.

    ``max_frame`` bounds what :meth:`receive` reads (each side keeps it small until the peer proved
    the token, so an unauthenticated connection cannot make it hold a 16 MiB buffer). Every send has a
    deadline: ``send_timeout`` seconds plus the frame's size at :data:`MIN_SEND_RATE`; a peer that does
    not take the frame by then has stopped reading, and the send raises :class:`PeerStalled` (the
    stream then holds part of a frame: close it)."""

    def __init__(self, stream: trio.abc.Stream, *, max_frame: int = MAX_FRAME_BYTES,
                 send_timeout: float = SEND_TIMEOUT) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self.send_timeout = send_timeout
        self._send_lock = trio.Lock()
        self._buffer = bytearray()
        self._key: bytes | None = None
        self._send_label = self._receive_label = b""
        self._sent = self._received = 0
        #: a send was interrupted once it may have written part of its frame: nothing can follow on this stream
        self.frame_cut = False
        self.last_frame_bytes = 0  # the size of the frame :meth:`receive` read last (what a reader paces by)

    def authenticate(self, key: bytes, *, authority: bool) -> None:
        """Tag every frame from now on, and refuse every frame that does not carry its tag (see the module)."""
        self._key = key
        self._send_label, self._receive_label = (b"A", b"W") if authority else (b"W", b"A")
        self._sent = self._received = 0

    def _tag(self, label: bytes, number: int, data: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, label + number.to_bytes(8, "big") + data, hashlib.sha256).digest()

    async def send(self, message: Message) -> None:
        await self.send_body(body_of(message), message.TYPE)

    async def send_body(self, data: bytes, what: str = "a frame") -> None:
        """Frame ``data`` (a message's JSON, see :func:`body_of`), tag it once authenticated, and send it."""
        async with self._send_lock:
            # a cancel that comes before any byte went out leaves the stream whole (and the tags' count as it
            # was), so a last frame may still follow: the authority's goodbye as its stop cancels a pending send
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._key is not None:
                data += self._tag(self._send_label, self._sent, data)
                self._sent += 1
            deadline = self.send_timeout + len(data) / MIN_SEND_RATE
            self.frame_cut = True
            try:
                with trio.move_on_after(deadline) as sending:
                    await self.stream.send_all(_HEADER.pack(len(data)) + data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _broken(f"sending {what}", exc) from exc
            if not sending.cancelled_caught:
                self.frame_cut = False
            if sending.cancelled_caught:
                raise PeerStalled(f"sending {what}: the peer did not take its {len(data)} bytes within "
                                  f"{deadline:.0f} s (it stopped reading)")

    async def _fill(self, size: int) -> None:
        while len(self._buffer) < size:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _broken("connection broke", exc) from exc
            if not data:
                raise ConnectionClosed("the peer closed the connection")
            self._buffer += data

    async def receive(self) -> Message:
        tag = TAG_BYTES if self._key is not None else 0
        await self._fill(_HEADER.size)
        (size,) = _HEADER.unpack(self._buffer[: _HEADER.size])
        if size > self.max_frame + tag:
            start = bytes(self._buffer[: _HEADER.size])
            text = start.isascii() and start.decode("ascii").isprintable()  # b"HTTP": an HTTP server's answer
            hint = f" (it begins {start.decode('ascii')!r}: another protocol's text, not a frame)" if text else ""
            if start[:2] == b"\x16\x03":  # a TLS handshake record (it read as a 369 MB frame)
                hint = " (it begins a TLS handshake: the peer dials tls://, this port is plain tcp:// with no certificate)"
            raise WireError(f"a frame of {size} bytes exceeds the {self.max_frame}-byte limit{hint}")
        if size < tag:
            raise WireError(f"a frame of {size} bytes is too short to carry its authentication tag")
        await self._fill(_HEADER.size + size)
        body = bytes(self._buffer[_HEADER.size : _HEADER.size + size - tag])
        got = bytes(self._buffer[_HEADER.size + size - tag : _HEADER.size + size])
        del self._buffer[: _HEADER.size + size]
        self.last_frame_bytes = _HEADER.size + size
        if tag:
            if not hmac.compare_digest(got, self._tag(self._receive_label, self._received, body)):
                raise WireError(
                    f"frame {self._received} does not carry its authentication tag: changed, replayed or dropped "
                    "on the way, or the peer holds another cluster token"
                )
            self._received += 1
        return decode(body)

    async def aclose(self) -> None:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            await self.stream.aclose()

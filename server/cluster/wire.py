"""The authority <-> worker-agent wire: versioned attrs messages in length-prefixed JSON frames.

One TCP connection per agent (plain, or TLS when the authority has a certificate:
:func:`wrap_client_tls` / :func:`wrap_server_tls` put a ``trio.SSLStream`` under the
same framing). A frame is a 4-byte big-endian length and that many bytes of UTF-8
JSON: ``{"v": PROTOCOL, "type": "<name>", ...fields}``. Frames above
:data:`MAX_FRAME_BYTES` and unknown types, versions or fields are refused with a
:class:`WireError` that names what was wrong.

Handshake: the authority speaks first with :class:`Hello` (a fresh nonce); the agent
answers :class:`Register` whose ``proof`` is ``HMAC-SHA256(cluster token, nonce +
worker id)``, so the token itself never crosses the wire; the authority answers
:class:`Welcome` or :class:`Refused` (then closes). After that the agent sends
:class:`Ready`, :class:`Heartbeat`, :class:`SessionEvent`, :class:`SessionFinished`,
:class:`Failed`, :class:`OptionsChecked` and :class:`Goodbye`; the authority sends :class:`HeartbeatAck`,
:class:`Start`, :class:`Stop`, :class:`Drain` and :class:`CheckOptions`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import ssl
import struct
from typing import Any, ClassVar

import attrs
import trio

from ..json_limits import JsonRefused, loads as json_loads

__all__ = [
    "PROTOCOL",
    "MAX_FRAME_BYTES",
    "MAX_HANDSHAKE_FRAME_BYTES",
    "MAX_CAPACITY",
    "WireError",
    "ConnectionClosed",
    "Channel",
    "Message",
    "Hello",
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
    "CheckOptions",
    "OptionsChecked",
    "Goodbye",
    "proof_for",
    "proof_matches",
    "encode",
    "decode",
    "wrap_client_tls",
    "wrap_server_tls",
]

PROTOCOL = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024  # a Start may carry an uploaded image (bounded by the API's body limit)
#: the largest frame a peer may send before it proved the token (a Register is well under 1 KiB)
MAX_HANDSHAKE_FRAME_BYTES = 64 * 1024
#: the most sessions one agent may report it can retain (the CLI's --max-sessions allows 64)
MAX_CAPACITY = 4096
MAX_JSON_DEPTH = 64  # a Start's config is at most the API's depth (32) inside the message
_HEADER = struct.Struct(">I")


class WireError(ValueError):
    """A frame or message that breaks the protocol; the connection is closed with this reason."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError("must be text")
    return value


def _opt_str(value: object) -> str | None:
    return None if value is None else _str(value)


def _num(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("must be a number")
    return float(value)


def _seconds(value: object) -> float:
    seconds = _num(value)
    if not 0 < seconds < math.inf:
        raise TypeError(f"must be a number of seconds > 0, got {seconds!r}")
    return seconds


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("must be an integer")
    return value


def _ints(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise TypeError("must be a list of integers")
    return tuple(_int(v) for v in value)


def _strs(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise TypeError("must be a list of text")
    return tuple(_str(v) for v in value)


def _dict(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("must be an object")
    return value


def _opt_dict(value: object) -> dict[str, Any] | None:
    return None if value is None else _dict(value)


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
    nonce: str = attrs.field(converter=_str)
    authority_version: str = attrs.field(converter=_str)


@attrs.frozen
class Register(Message):
    TYPE = "register"
    worker_id: str = attrs.field(converter=_str)
    proof: str = attrs.field(converter=_str)
    version: str = attrs.field(converter=_str)
    pipeline: str = attrs.field(converter=_str)  # the pipeline's name (file or package name)
    pipeline_digest: str = attrs.field(converter=_str)
    node: str = attrs.field(converter=_str)
    devices: tuple[int, ...] = attrs.field(converter=_ints)
    launcher: str = attrs.field(converter=_str)
    pid: int = attrs.field(converter=_int)
    slot: str | None = attrs.field(default=None, converter=_opt_str)  # the launcher's slot, when it has one


@attrs.frozen
class Welcome(Message):
    TYPE = "welcome"
    worker_id: str = attrs.field(converter=_str)
    heartbeat_interval: float = attrs.field(converter=_seconds)
    deadline: float = attrs.field(converter=_seconds)
    transport: str = attrs.field(converter=_str)
    rooms_url: str | None = attrs.field(converter=_opt_str)  # local rooms: the authority's HTTP base URL
    livekit_url: str | None = attrs.field(converter=_opt_str)
    controller_timeout: float = attrs.field(converter=_seconds)
    room_empty_timeout: float = attrs.field(converter=_seconds)
    max_data_message_bytes: int = attrs.field(converter=_int)


@attrs.frozen
class Refused(Message):
    TYPE = "refused"
    reason: str = attrs.field(converter=_str)


def _capacity(value: object) -> int:
    capacity = _int(value)
    if not 1 <= capacity <= MAX_CAPACITY:
        raise TypeError(f"capacity must be 1-{MAX_CAPACITY}, got {capacity}")
    return capacity


_PLAN_FIELDS = {"computed_capacity": True, "effective_capacity": False, "configured_limit": True}


def _plan(value: object) -> dict[str, Any]:
    """A capacity plan as the agent's ``CapacityPlan.to_dict`` makes it: its counts are integers."""
    plan = _dict(value)
    missing = [name for name in (*_PLAN_FIELDS, "limiting_device") if name not in plan]
    if missing:
        raise TypeError(f"plan lacks {', '.join(missing)}")
    for name, optional in _PLAN_FIELDS.items():
        count = plan.get(name)
        if not (count is None and optional) and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise TypeError(f"plan.{name} must be an integer >= 0{' or null' if optional else ''}, got {count!r}")
    if not isinstance(plan.get("limiting_device"), str | None):
        raise TypeError("plan.limiting_device must be text or null")
    return plan


@attrs.frozen
class Ready(Message):
    TYPE = "ready"
    capacity: int = attrs.field(converter=_capacity)
    kind: str = attrs.field(converter=_str)
    plan: dict[str, Any] = attrs.field(converter=_plan)
    startup_check: dict[str, Any] = attrs.field(converter=_dict, factory=dict)  # the agent's: passed or skipped


@attrs.frozen
class Failed(Message):
    TYPE = "failed"
    reason: str = attrs.field(converter=_str)


@attrs.frozen
class Heartbeat(Message):
    TYPE = "heartbeat"
    seq: int = attrs.field(converter=_int)
    sessions: tuple[str, ...] = attrs.field(converter=_strs)


@attrs.frozen
class HeartbeatAck(Message):
    TYPE = "heartbeat_ack"
    seq: int = attrs.field(converter=_int)


@attrs.frozen
class Start(Message):
    TYPE = "start"
    session_id: str = attrs.field(converter=_str)
    room: str = attrs.field(converter=_str)
    identity: str = attrs.field(converter=_str)  # the worker's participant identity in the room
    token: str = attrs.field(converter=_str)  # minted by the authority for that identity and room
    controller_identity: str = attrs.field(converter=_str)
    prompt: str | None = attrs.field(converter=_opt_str)
    config: dict[str, Any] = attrs.field(converter=_dict)
    image: str | None = attrs.field(converter=_opt_str)  # base64 of the reference image, if any
    image_suffix: str | None = attrs.field(default=None, converter=_opt_str)


@attrs.frozen
class Stop(Message):
    TYPE = "stop"
    session_id: str = attrs.field(converter=_str)
    cause: str = attrs.field(converter=_str)
    now: bool = attrs.field(default=False, converter=bool)  # cancel waiting at once (cleanup still runs)


@attrs.frozen
class Drain(Message):
    TYPE = "drain"
    deadline: float = attrs.field(converter=_seconds)  # seconds live sessions may take to finish


@attrs.frozen
class SessionEvent(Message):
    """A stream-session table event the agent's runner applied; the authority applies the same."""

    TYPE = "session_event"
    session_id: str = attrs.field(converter=_str)
    seq: int = attrs.field(converter=_int)
    event: str = attrs.field(converter=_str)
    error: str | None = attrs.field(default=None, converter=_opt_str)
    pipeline_session_id: str | None = attrs.field(default=None, converter=_opt_str)
    participants: tuple[str, ...] = attrs.field(default=(), converter=_strs)


@attrs.frozen
class SessionFinished(Message):
    TYPE = "session_finished"
    session_id: str = attrs.field(converter=_str)
    seq: int = attrs.field(converter=_int)
    error: str | None = attrs.field(converter=_opt_str)
    drain_cause: str | None = attrs.field(converter=_opt_str)


@attrs.frozen
class CheckOptions(Message):
    """Check a create's session options with the agent's pipeline (the create waits for the answer)."""

    TYPE = "check_options"
    check_id: int = attrs.field(converter=_int)
    options: dict[str, Any] = attrs.field(converter=_dict)


@attrs.frozen
class OptionsChecked(Message):
    """The answer: ``refused`` is the pipeline's reason, ``error`` why it could not check; both None: accepted."""

    TYPE = "options_checked"
    check_id: int = attrs.field(converter=_int)
    refused: str | None = attrs.field(default=None, converter=_opt_str)
    error: str | None = attrs.field(default=None, converter=_opt_str)


@attrs.frozen
class Goodbye(Message):
    TYPE = "goodbye"
    reason: str = attrs.field(converter=_str)


def encode(message: Message) -> bytes:
    body = {"v": PROTOCOL, "type": message.TYPE, **attrs.asdict(message, recurse=False)}
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"a {message.TYPE} message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return _HEADER.pack(len(data)) + data


def decode(data: bytes) -> Message:
    """One frame body to its message; :class:`WireError` names what is wrong."""
    try:
        body = json_loads(data, max_depth=MAX_JSON_DEPTH)
    except JsonRefused as exc:
        raise WireError(f"a frame is not valid JSON: {exc.detail}") from None
    if not isinstance(body, dict):
        raise WireError("a frame must be a JSON object")
    version = body.pop("v", None)
    if version != PROTOCOL:
        raise WireError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL})")
    kind = body.pop("type", None)
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown message type {kind!r}")
    names = {f.name for f in attrs.fields(cls)}
    unknown = sorted(set(body) - names)
    if unknown:
        raise WireError(f"{kind}: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**body)
    except TypeError as exc:
        raise WireError(f"{kind}: {exc}") from None


class Channel:
    """Framed messages over one byte stream; one sender at a time, one receiver.

    ``max_frame`` bounds what :meth:`receive` reads (the authority keeps it small until the peer proved
    the token, so an unauthenticated connection cannot make it hold a 16 MiB buffer)."""

    def __init__(self, stream: trio.abc.Stream, *, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self._send_lock = trio.Lock()
        self._buffer = bytearray()

    async def send(self, message: Message) -> None:
        frame = encode(message)
        async with self._send_lock:
            try:
                await self.stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise ConnectionClosed(f"sending {message.TYPE}: {exc}") from exc

    async def _fill(self, size: int) -> None:
        while len(self._buffer) < size:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise ConnectionClosed(f"connection broke: {exc}") from exc
            if not data:
                raise ConnectionClosed("the peer closed the connection")
            self._buffer += data

    async def receive(self) -> Message:
        await self._fill(_HEADER.size)
        (size,) = _HEADER.unpack(self._buffer[: _HEADER.size])
        if size > self.max_frame:
            raise WireError(f"a frame of {size} bytes exceeds the {self.max_frame}-byte limit")
        await self._fill(_HEADER.size + size)
        body = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
        del self._buffer[: _HEADER.size + size]
        return decode(body)

    async def aclose(self) -> None:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            await self.stream.aclose()


def proof_for(token: str, nonce: str, worker_id: str) -> str:
    return hmac.new(token.encode(), (nonce + worker_id).encode(), hashlib.sha256).hexdigest()


def proof_matches(token: str, nonce: str, worker_id: str, proof: str) -> bool:
    return hmac.compare_digest(proof_for(token, nonce, worker_id), proof)


def wrap_server_tls(stream: trio.abc.Stream, cert_file: str, key_file: str) -> trio.SSLStream:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return trio.SSLStream(stream, context, server_side=True)


def wrap_client_tls(stream: trio.abc.Stream, host: str, ca_file: str | None) -> trio.SSLStream:
    context = ssl.create_default_context(cafile=ca_file)
    return trio.SSLStream(stream, context, server_hostname=host)

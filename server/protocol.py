"""The room data protocol: controls in on ``tf.control``, status out on ``tf.status``.

Pure functions, no I/O and no clock except the default ``timestamp`` of the
message builders.

Controls (reference B.7)
------------------------
:func:`parse_control` turns one data packet into a normalized
:class:`~pipelines.contract.Control` (or a :class:`DeliveryAck`), or raises
:class:`InvalidControl` whose ``reason`` is a short stable code (see
:data:`REJECTION_REASONS`) and whose ``detail`` is a short human sentence, both
safe to send back to the controller (:func:`rejection_message`).

Two shapes are accepted:

* legacy flat: ``{"type": "control_state", "controls": ["w", "j"]}``;
* envelope: ``{"version": 1, "session_id"?: ..., "type": ..., "payload": {...}}``;
  the payload's fields are merged under ``type`` and validated like a legacy
  message. A message is an envelope when it has a ``version`` or ``payload``
  key. A missing (or null) ``payload`` is ``{}``; a payload ``type`` that
  differs from the envelope's is ``bad_payload``.

Checks, in this order (the first failure wins):

==================  ===========================================================
reason              when
==================  ===========================================================
server_topic        ``topic`` is ``tf.status`` or ``tf.metrics``: only the server speaks there
wrong_topic         ``topic`` is not ``tf.control``
not_controller      the sender identity is missing, empty, or not the
                    controller's (the reference accepted an empty identity, F.7)
too_large           the raw bytes (UTF-8 for ``str``) exceed ``max_bytes``;
                    mappings skip this check
invalid_json        not UTF-8, not JSON, NaN/Infinity, a duplicated object key,
                    nested deeper than 32 levels, a lone surrogate in a string,
                    or a number too large for a float (1e400)
not_an_object       the JSON value (or the argument) is not an object
bad_version         an envelope whose ``version`` is not the integer 1
wrong_session       a non-null ``session_id`` (envelope, its payload, or flat) that
                    is not the active session's
bad_payload         an envelope payload that is not an object, a payload ``type``
                    that contradicts the envelope's, or a malformed
                    ``delivery_ack`` field
unknown_type        ``type`` missing, not a string, or not one of
                    :data:`MESSAGE_TYPES`
bad_controls        ``control_state.controls`` missing or not a list of strings;
                    ``control`` without a string ``control``/``key``
unknown_control     a control name that is not a known key or alias (the refusal lists them)
duplicate_control   ``control_state`` naming one key twice (after aliasing)
unknown_event       a ``control`` event that is not a string or not one of
                    press, release, keyup, end, reset, reset_pose
conflicting_fields  a ``control`` whose ``control`` and ``key`` name different keys,
                    or whose ``event`` and ``action`` mean different things: the
                    message says two things, and either taken would be a guess
bad_prompt          ``prompt`` not a string, blank, over 2000 characters or not valid
                    text (a lone surrogate): ``pipelines.contract.prompt_problem``
misspelt_field      a field the message does not read that is a near miss of one it
                    does (``evnt`` for ``event``, ``sesion_id``): taken as it stands,
                    the message would do something else than its sender meant
==================  ===========================================================

Types: ``control_state`` (the set of held keys), ``control`` (one key:
``control``/``key`` plus ``event``/``action``, default ``press``, case-folded;
``release``/``keyup``/``end`` release; events ``reset``/``reset_pose`` become
the RESET/RESET_POSE controls), ``prompt``, ``reset``, ``reset_pose``,
``stop``, and ``delivery_ack`` (F.9: the controller confirms it received the
stream; optional ``received_frames`` >= 0) which yields a :class:`DeliveryAck`.
Other unknown extra fields are ignored (clients add their own: ``timestamp``, ``seq``...).

Key aliases, normalized to ``w a s d i j k l`` (exact spelling, case matters):
``ArrowUp``/``up``/``forward`` -> w, ``ArrowDown``/``down``/``backward`` -> s,
``ArrowLeft``/``left`` -> a, ``ArrowRight``/``right`` -> d, ``KeyW`` ...
``KeyL`` -> the letter.

Status (fix of F.16)
--------------------
Every message on ``tf.status`` is a JSON object with its real ``type`` at the
top level (``status``, ``chunk``, ``done``, ``error``, ``control_rejected``,
``lease_queued``, ``lease_granted``, ``lease_parked``; and ``metrics`` on ``tf.metrics``), the ``session_id`` and a float
``timestamp``. Free-form extras (status, chunk and metrics data) are nested
under ``data`` so they can never shadow those fields. Values that JSON
cannot carry (numpy scalars aside, which become numbers) are stringified.

A ``control_rejected`` may carry ``count``: how many messages it answers (``dropped``: on LiveKit, messages a
sender's newer one replaced while they waited their turn, told once before the one that replaced them is read).

Addressing: ``control_rejected`` answers one participant's message and goes to
that participant alone (LiveKit: ``destination_identities``; local rooms: its
socket alone); a sender the transport cannot name gets no answer. The rest is
the room's news and goes to every participant. Until this was so, every
participant received every rejection (message shapes are unchanged: clients
need no change, and ``PROTOCOL_VERSION`` stays 1).
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from pipelines.contract import KNOWN_KEYS, MAX_PROMPT_CHARS, Control, ControlType, prompt_problem

from . import json_limits
from .reasons import echo

__all__ = [
    "CONTROL_TOPIC",
    "DEFAULT_MAX_BYTES",
    "KEY_ALIASES",
    "MAX_PROMPT_CHARS",
    "MESSAGE_TYPES",
    "METRICS_TOPIC",
    "PROTOCOL_VERSION",
    "REJECTION_REASONS",
    "STATUS_TOPIC",
    "InvalidControl",
    "DeliveryAck",
    "chunk_message",
    "done_message",
    "error_message",
    "lease_message",
    "metrics_message",
    "normalize_key",
    "parse_control",
    "rejection_message",
    "status_message",
]

CONTROL_TOPIC: Final = "tf.control"
STATUS_TOPIC: Final = "tf.status"
METRICS_TOPIC: Final = "tf.metrics"

PROTOCOL_VERSION: Final = 1
DEFAULT_MAX_BYTES: Final = 12288

REJECTION_REASONS: Final = frozenset(
    {
        "server_topic",
        "wrong_topic",
        "not_controller",
        "too_large",
        "invalid_json",
        "not_an_object",
        "bad_version",
        "wrong_session",
        "bad_payload",
        "unknown_type",
        "bad_controls",
        "unknown_control",
        "duplicate_control",
        "unknown_event",
        "bad_prompt",
        "misspelt_field",
        "conflicting_fields",
    }
)

DELIVERY_ACK: Final = "delivery_ack"
LEASE_EVENTS: Final = frozenset({"lease_queued", "lease_granted", "lease_parked"})
MESSAGE_TYPES: Final = frozenset({t.value for t in ControlType} | {DELIVERY_ACK})

KEY_ALIASES: Final[Mapping[str, str]] = {
    **{key: key for key in KNOWN_KEYS},
    **{f"Key{key.upper()}": key for key in KNOWN_KEYS},
    "ArrowUp": "w",
    "ArrowDown": "s",
    "ArrowLeft": "a",
    "ArrowRight": "d",
    "up": "w",
    "forward": "w",
    "down": "s",
    "backward": "s",
    "left": "a",
    "right": "d",
}

#: what an ``unknown_control`` refusal lists: the keys, then the other names taken for them
KNOWN_CONTROLS: Final = (
    f"known keys: {' '.join(sorted(KNOWN_KEYS))} (or Key and the letter, as KeyW); also "
    + " ".join(sorted(name for name in KEY_ALIASES if name not in KNOWN_KEYS and not name.startswith("Key")))
)

# event -> pressed (bool) for key events, or the control type it stands for.
_EVENTS: Final[Mapping[str, bool | ControlType]] = {
    "press": True,
    "release": False,
    "keyup": False,
    "end": False,
    "reset": ControlType.RESET,
    "reset_pose": ControlType.RESET_POSE,
}

_SIMPLE_TYPES: Final = {
    ControlType.RESET.value: ControlType.RESET,
    ControlType.RESET_POSE.value: ControlType.RESET_POSE,
    ControlType.STOP.value: ControlType.STOP,
}


class InvalidControl(ValueError):
    """A control packet was refused; ``reason`` is a code from :data:`REJECTION_REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@attrs.frozen
class DeliveryAck:
    """The controller confirmed it received the stream (lossless delivery, F.9)."""

    session_id: str
    received_frames: int | None = None


def normalize_key(name: object) -> str | None:
    """The normalized key for a control name or alias, or None if unknown."""
    return KEY_ALIASES.get(name) if isinstance(name, str) else None


# -- parsing ------------------------------------------------------------------


def _decode(raw: bytes | str, max_bytes: int) -> Any:
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidControl("too_large", f"{size} bytes; at most {max_bytes} allowed")
    try:
        return json_limits.loads(raw)  # an object naming a key twice is refused too
    except json_limits.JsonRefused as exc:
        # the parser's own words: "not valid JSON (NaN is not JSON)" said "not valid UTF-8 JSON" of valid UTF-8
        detail = f"the message is {exc.detail}" if exc.reason == "invalid_json" else exc.detail
        raise InvalidControl("invalid_json", detail) from exc


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def parse_control(
    raw: bytes | str | Mapping[str, Any],
    *,
    topic: str,
    sender_identity: str | None,
    controller_identity: str,
    session_id: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Control | DeliveryAck:
    """Validate and normalize one control packet; raises :class:`InvalidControl`."""
    if topic in (STATUS_TOPIC, METRICS_TOPIC):  # as the local rooms refuse it (LiveKit passes it to the worker)
        raise InvalidControl("server_topic", f"{topic!r} is the server's topic; clients may not publish on it")
    if topic != CONTROL_TOPIC:
        raise InvalidControl("wrong_topic", f"controls are accepted on {CONTROL_TOPIC!r} only")
    if not sender_identity or not isinstance(sender_identity, str) or sender_identity != controller_identity:
        raise InvalidControl("not_controller", "only the controller may send control messages")

    if isinstance(raw, bytearray | memoryview):
        raw = bytes(raw)
    if isinstance(raw, bytes | str):
        message = _decode(raw, max_bytes)
    else:
        message = raw
    if not isinstance(message, Mapping):
        raise InvalidControl("not_an_object", "a control message must be a JSON object")

    if "version" in message or "payload" in message:
        version = message.get("version")
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise InvalidControl("bad_version", f"envelope version must be {PROTOCOL_VERSION}")
    _check_session(message, session_id)
    fields = _merge_envelope(message) if ("version" in message or "payload" in message) else message
    if fields is not message:
        _check_session(fields, session_id)  # the payload's own, which the message would otherwise carry unread

    kind = fields.get("type")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise InvalidControl("unknown_type", f"type {echo(kind)} is not one of {sorted(MESSAGE_TYPES)}")
    if fields is not message:
        _refuse_near_misses(message, _ENVELOPE_FIELDS)
    _refuse_near_misses(fields, _FIELDS_READ[kind])

    if kind == ControlType.CONTROL_STATE.value:
        return Control(ControlType.CONTROL_STATE, keys=_held_keys(fields))
    if kind == ControlType.CONTROL.value:
        return _key_event(fields)
    if kind == ControlType.PROMPT.value:
        return Control(ControlType.PROMPT, prompt=_prompt(fields))
    if kind == DELIVERY_ACK:
        return _delivery_ack(fields, session_id)
    return Control(_SIMPLE_TYPES[kind])


# the fields each message type reads (its own, and the type and session id every one may carry)
_OWN_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    ControlType.CONTROL_STATE.value: frozenset({"controls"}),
    ControlType.CONTROL.value: frozenset({"control", "key", "event", "action"}),
    ControlType.PROMPT.value: frozenset({"prompt"}),
    DELIVERY_ACK: frozenset({"received_frames"}),
}
_FIELDS_READ: Final = {kind: _OWN_FIELDS.get(kind, frozenset()) | {"type", "session_id"} for kind in MESSAGE_TYPES}
_ENVELOPE_FIELDS: Final = frozenset({"version", "type", "session_id", "payload"})


def _refuse_near_misses(fields: Mapping[str, Any], read: frozenset[str]) -> None:
    """A field not read that is a near miss of one that is (``evnt``): the sender meant that one, and the message
    taken without it would do something else (a release read as a press)."""
    for name in fields:
        if isinstance(name, str) and name not in read:
            near = difflib.get_close_matches(name, read, n=1, cutoff=0.8)
            if near:
                raise InvalidControl("misspelt_field", f"field {echo(name)} is not one this message reads; "
                                                       f"did you mean {near[0]!r}?")


def _check_session(message: Mapping[str, Any], session_id: str) -> None:
    claimed = message.get("session_id")
    if claimed is not None and claimed != session_id:
        raise InvalidControl("wrong_session", "the message names another session")


def _merge_envelope(message: Mapping[str, Any]) -> Mapping[str, Any]:
    payload = message.get("payload")
    if payload is None:
        payload = {}
    if not isinstance(payload, Mapping):
        raise InvalidControl("bad_payload", "the envelope payload must be an object")
    fields = dict(payload)
    if "type" in message:
        if "type" in payload and payload["type"] != message["type"]:
            raise InvalidControl("bad_payload", "the payload type contradicts the envelope type")
        fields["type"] = message["type"]
    return fields


def _held_keys(fields: Mapping[str, Any]) -> frozenset[str]:
    controls = fields.get("controls")
    if not _is_list(controls) or not all(isinstance(name, str) for name in controls):
        raise InvalidControl("bad_controls", "control_state needs 'controls': a list of strings")
    held: set[str] = set()
    for name in controls:
        key = normalize_key(name)
        if key is None:
            raise InvalidControl("unknown_control", f"unknown control {echo(name)}; {KNOWN_CONTROLS}")
        if key in held:
            raise InvalidControl("duplicate_control", f"control {echo(name)} repeats key {key!r}")
        held.add(key)
    return frozenset(held)


def _key_event(fields: Mapping[str, Any]) -> Control:
    keys = [_named_key(fields[field]) for field in ("control", "key") if field in fields] or [_named_key(None)]
    if len(set(keys)) > 1:
        raise InvalidControl("conflicting_fields", f"'control' names key {keys[0]!r} and 'key' names {keys[1]!r}: "
                                                   "send one of them")
    meanings = [_event_meaning(fields[field]) for field in ("event", "action") if field in fields] or [True]
    if len(set(meanings)) > 1:
        raise InvalidControl("conflicting_fields", f"'event' {echo(fields['event'])} and 'action' "
                                                   f"{echo(fields['action'])} mean different things: send one of them")
    meaning = meanings[0]  # a press unless told otherwise
    if isinstance(meaning, ControlType):
        return Control(meaning)
    return Control(ControlType.CONTROL, key=keys[0], pressed=meaning)


def _named_key(name: Any) -> str:
    if not isinstance(name, str):
        raise InvalidControl("bad_controls", "a control message needs a string 'control' (or 'key')")
    key = normalize_key(name)
    if key is None:
        raise InvalidControl("unknown_control", f"unknown control {echo(name)}; {KNOWN_CONTROLS}")
    return key


def _event_meaning(event: Any) -> bool | ControlType:
    meaning = _EVENTS.get(event.lower()) if isinstance(event, str) else None
    if meaning is None:
        raise InvalidControl("unknown_event", f"event {echo(event)} is not one of {sorted(_EVENTS)}")
    return meaning


def _prompt(fields: Mapping[str, Any]) -> str:
    prompt = fields.get("prompt")
    problem = prompt_problem(prompt)
    if problem is not None:
        raise InvalidControl("bad_prompt", f"a prompt message's 'prompt' {problem}")
    return prompt


def _delivery_ack(fields: Mapping[str, Any], session_id: str) -> DeliveryAck:
    frames = fields.get("received_frames")
    if frames is not None and (type(frames) is not int or frames < 0):
        raise InvalidControl("bad_payload", "received_frames must be an integer >= 0")
    return DeliveryAck(session_id=session_id, received_frames=frames)


# -- status messages ----------------------------------------------------------

_MAX_DEPTH: Final = 32


def _jsonable(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy of ``value``; anything JSON cannot carry becomes ``str(value)``."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else str(value)
    if depth >= _MAX_DEPTH:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, set | frozenset):
        items = [_jsonable(v, depth + 1) for v in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    return str(value)


def _message(kind: str, session_id: str, timestamp: float | None, body: Mapping[str, Any]) -> bytes:
    message = {
        "type": kind,
        "session_id": session_id,
        **body,
        "timestamp": time.time() if timestamp is None else float(timestamp),
    }
    return json.dumps(_jsonable(message), separators=(",", ":"), allow_nan=False).encode("utf-8")


def status_message(session_id: str, stage: str, /, *, timestamp: float | None = None, **data: Any) -> bytes:
    """A lifecycle status (``stage`` such as ``connected``, ``generating``); extras go in ``data``."""
    return _message("status", session_id, timestamp, {"stage": stage, "data": data})


def metrics_message(session_id: str, /, *, timestamp: float | None = None, **data: Any) -> bytes:
    """Serving measurements for ``tf.metrics`` (lossy); the values go in ``data``."""
    return _message("metrics", session_id, timestamp, {"data": data})


def chunk_message(
    session_id: str, index: int, data: Mapping[str, Any], *, timestamp: float | None = None
) -> bytes:
    """The metadata of one published chunk (media fields already stripped)."""
    return _message("chunk", session_id, timestamp, {"index": index, "data": data})


def done_message(
    session_id: str, total_chunks: int, published_frames: int, *, reason: str | None = None,
    timestamp: float | None = None,
) -> bytes:
    """The stream ended normally; ``reason`` is the drain cause (``stop``, ``deleted``, ``room_empty``...)."""
    return _message(
        "done", session_id, timestamp,
        {"total_chunks": total_chunks, "published_frames": published_frames, "reason": reason},
    )


def error_message(session_id: str, reason: str, detail: str, *, timestamp: float | None = None) -> bytes:
    """The session failed."""
    return _message("error", session_id, timestamp, {"reason": reason, "detail": detail})


def rejection_message(
    session_id: str, reason: str, detail: str, *, count: int | None = None, timestamp: float | None = None
) -> bytes:
    """The answer to a refused control (a :class:`InvalidControl` or a service's ControlRejected), for its
    sender alone; ``count``: how many messages it answers (``dropped``: a transport could not hand them on)."""
    fields: dict[str, Any] = {"reason": reason, "detail": detail}
    if count is not None:
        fields["count"] = count
    return _message("control_rejected", session_id, timestamp, fields)


def lease_message(
    session_id: str, event: str, queue_position: int | None, *, timestamp: float | None = None
) -> bytes:
    """An execution-lease change; its ``type`` is the event itself (``lease_queued``,
    ``lease_granted`` or ``lease_parked``), so clients switch on ``type`` alone."""
    if event not in LEASE_EVENTS:
        raise ValueError(f"unknown lease event {event!r}; expected one of {sorted(LEASE_EVENTS)}")
    return _message(event, session_id, timestamp, {"queue_position": queue_position})

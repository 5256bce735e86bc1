"""The control data protocol (server.protocol): the topics, every message shape and key alias accepted, and every
refusal with its reason, checked in order. (Random messages: ``test_protocol_fuzz.py``; the status messages the
server sends: ``test_protocol_status_messages.py``.)"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import pytest

from pipelines.contract import KNOWN_KEYS, Control, ControlType
from server.protocol import (
    CONTROL_TOPIC,
    KEY_ALIASES,
    KNOWN_CONTROLS,
    METRICS_TOPIC,
    REJECTION_REASONS,
    STATUS_TOPIC,
    InvalidControl,
    DeliveryAck,
    normalize_key,
)
from server.reasons import MAX_ECHO

from .protocol_helpers import SESSION, as_json, envelope, parse, rejected


def test_topics() -> None:
    assert (CONTROL_TOPIC, STATUS_TOPIC, METRICS_TOPIC) == ("tf.control", "tf.status", "tf.metrics")


# -- accepted shapes ----------------------------------------------------------


def state(*keys: str) -> Control:
    return Control(ControlType.CONTROL_STATE, keys=frozenset(keys))


def press(key: str, pressed: bool = True) -> Control:
    return Control(ControlType.CONTROL, key=key, pressed=pressed)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"type": "control_state", "controls": ["w", "j"]}, state("w", "j")),
        ({"type": "control_state", "controls": []}, state()),
        ({"type": "control_state", "controls": ["ArrowUp", "KeyJ", "left"]}, state("w", "j", "a")),
        ({"type": "control", "control": "w"}, press("w")),
        ({"type": "control", "key": "ArrowDown", "event": "press"}, press("s")),
        ({"type": "control", "control": "d", "event": "release"}, press("d", False)),
        ({"type": "control", "control": "d", "event": "keyup"}, press("d", False)),
        ({"type": "control", "control": "d", "event": "end"}, press("d", False)),
        ({"type": "control", "control": "d", "action": "RELEASE"}, press("d", False)),
        ({"type": "control", "control": "i", "event": "Press"}, press("i")),
        ({"type": "control", "control": "w", "event": "reset"}, Control(ControlType.RESET)),
        ({"type": "control", "control": "w", "event": "reset_pose"}, Control(ControlType.RESET_POSE)),
        ({"type": "control", "control": "w", "key": "KeyW"}, press("w")),  # both name one key: taken
        ({"type": "control", "control": "w", "event": "release", "action": "keyup"}, press("w", False)),
        ({"type": "prompt", "prompt": "a snowy forest"}, Control(ControlType.PROMPT, prompt="a snowy forest")),
        ({"type": "prompt", "prompt": "x" * 2000}, Control(ControlType.PROMPT, prompt="x" * 2000)),
        ({"type": "prompt", "prompt": "  padded  "}, Control(ControlType.PROMPT, prompt="  padded  ")),
        ({"type": "reset"}, Control(ControlType.RESET)),
        ({"type": "reset_pose"}, Control(ControlType.RESET_POSE)),
        ({"type": "stop"}, Control(ControlType.STOP)),
        ({"type": "stop", "session_id": SESSION, "extra": [1, 2]}, Control(ControlType.STOP)),
        ({"type": "stop", "session_id": None}, Control(ControlType.STOP)),
        (envelope("control_state", {"controls": ["KeyW", "KeyL"]}), state("w", "l")),
        (envelope("control", {"key": "ArrowRight", "action": "keyup"}, session_id=SESSION), press("d", False)),
        (envelope("prompt", {"prompt": "dusk"}), Control(ControlType.PROMPT, prompt="dusk")),
        (envelope("stop"), Control(ControlType.STOP)),
        (envelope("reset", {}), Control(ControlType.RESET)),
        ({"version": 1, "type": "reset_pose", "payload": None}, Control(ControlType.RESET_POSE)),
        (envelope("stop", {"type": "stop"}), Control(ControlType.STOP)),
        ({"version": 1, "payload": {"type": "stop"}}, Control(ControlType.STOP)),
        ({"type": "delivery_ack"}, DeliveryAck(SESSION)),
        ({"type": "delivery_ack", "received_frames": 120}, DeliveryAck(SESSION, 120)),
        (envelope("delivery_ack", {"received_frames": 0}), DeliveryAck(SESSION, 0)),
    ],
)
def test_accepted(message: dict[str, Any], expected: Control | DeliveryAck) -> None:
    assert parse(message) == expected  # a mapping
    assert parse(as_json(message)) == expected  # bytes
    assert parse(json.dumps(message)) == expected  # str
    assert parse(bytearray(as_json(message))) == expected
    assert parse(MappingProxyType(message)) == expected


@pytest.mark.parametrize(
    ("alias", "key"),
    [
        ("ArrowUp", "w"),
        ("ArrowDown", "s"),
        ("ArrowLeft", "a"),
        ("ArrowRight", "d"),
        ("up", "w"),
        ("forward", "w"),
        ("down", "s"),
        ("backward", "s"),
        ("left", "a"),
        ("right", "d"),
        *[(f"Key{k.upper()}", k) for k in sorted(KNOWN_KEYS)],
        *[(k, k) for k in sorted(KNOWN_KEYS)],
    ],
)
def test_every_alias(alias: str, key: str) -> None:
    assert normalize_key(alias) == key
    assert parse({"type": "control", "control": alias}) == press(key)
    assert parse({"type": "control_state", "controls": [alias]}) == state(key)


def test_alias_table_is_exactly_the_documented_one() -> None:
    assert set(KEY_ALIASES.values()) == KNOWN_KEYS
    assert len(KEY_ALIASES) == 8 + 8 + 4 + 6


@pytest.mark.parametrize("name", ["W", "keyw", "KeyZ", "ArrowUP", "arrowup", "Up", "z", " w", "", 3, None])
def test_non_aliases(name: object) -> None:
    assert normalize_key(name) is None


# -- rejections ---------------------------------------------------------------


def test_wrong_topic() -> None:
    for topic in ("tf.asset", "", None):
        assert rejected({"type": "stop"}, topic=topic).reason == "wrong_topic"


def test_the_servers_topics_are_refused_as_the_servers() -> None:
    """On LiveKit a client's data on tf.status reaches the worker (the local rooms refuse it first): the same
    reason as there, ``server_topic``, not ``wrong_topic``."""
    for topic in (STATUS_TOPIC, METRICS_TOPIC):
        refusal = rejected({"type": "stop"}, topic=topic)
        assert refusal.reason == "server_topic" and "the server's topic" in refusal.detail


def test_json_that_is_not_json_is_named_by_what_it_holds() -> None:
    refusal = rejected(b'{"type": "control_state", "controls": [], "x": NaN}')
    assert refusal.reason == "invalid_json" and refusal.detail == "the message is not valid JSON (NaN is not JSON)"


@pytest.mark.parametrize("sender", ["", None, "viewer-1", "controller-1 ", "Controller-1"])
def test_not_controller(sender: str | None) -> None:
    failure = rejected({"type": "stop"}, sender_identity=sender)
    assert failure.reason == "not_controller"
    assert failure.detail


def test_empty_controller_identity_never_matches() -> None:
    assert rejected({"type": "stop"}, sender_identity="", controller_identity="").reason == "not_controller"


def test_too_large() -> None:
    message = as_json({"type": "prompt", "prompt": "x" * 2000})
    assert parse(message, max_bytes=len(message)).type is ControlType.PROMPT
    assert rejected(message, max_bytes=len(message) - 1).reason == "too_large"
    assert rejected(b" " * 12289).reason == "too_large"
    assert rejected(b"{" * 12289).reason == "too_large"  # checked before parsing
    # str inputs are measured in UTF-8 bytes
    text = json.dumps({"type": "prompt", "prompt": "é" * 10}, ensure_ascii=False)
    assert rejected(text, max_bytes=len(text)).reason == "too_large"
    # mappings skip the size check
    assert parse({"type": "prompt", "prompt": "x" * 2000}, max_bytes=10).type is ControlType.PROMPT


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"{", b'{"type": "stop"', b"\xff\xfe", "{'type': 'stop'}", b'{"type": NaN}',
     b'{"n": Infinity}', b'{"type": "stop", "type": "reset"}', b"[" * 5000 + b"]" * 5000,
     '{"type": "stop"}'.encode("utf-16")],
)
def test_invalid_json(raw: bytes | str) -> None:
    assert rejected(raw).reason == "invalid_json"


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"stop"', b"null", b"true", [], ("stop",), 3, None])
def test_not_an_object(raw: Any) -> None:
    assert rejected(raw).reason == "not_an_object"


@pytest.mark.parametrize("version", [0, 2, "1", 1.0, True, None, [1]])
def test_bad_version(version: Any) -> None:
    message = {"version": version, "type": "stop", "payload": {}}
    assert rejected(message).reason == "bad_version"
    assert rejected(as_json(message)).reason == "bad_version"


def test_payload_without_version_is_bad_version() -> None:
    assert rejected({"type": "stop", "payload": {}}).reason == "bad_version"


@pytest.mark.parametrize("claimed", ["sess-2", "", 1, ["sess-1"]])
def test_wrong_session(claimed: Any) -> None:
    assert rejected(envelope("stop", session_id=claimed)).reason == "wrong_session"
    assert rejected({"type": "stop", "session_id": claimed}).reason == "wrong_session"


@pytest.mark.parametrize(
    "message",
    [
        envelope("stop", []),
        envelope("stop", "x"),
        envelope("stop", 1),
        envelope("stop", {"type": "reset"}),
        {"type": "delivery_ack", "received_frames": -1},
        {"type": "delivery_ack", "received_frames": 1.5},
        {"type": "delivery_ack", "received_frames": True},
        {"type": "delivery_ack", "received_frames": "3"},
    ],
)
def test_bad_payload(message: dict[str, Any]) -> None:
    assert rejected(message).reason == "bad_payload"


@pytest.mark.parametrize("kind", [None, "", "Stop", "asset", "chunk", 3, ["stop"], {"t": 1}])
def test_unknown_type(kind: Any) -> None:
    assert rejected({"type": kind}).reason == "unknown_type"
    assert rejected(envelope("x", {"type": kind}) | {"type": kind}).reason == "unknown_type"


def test_missing_type() -> None:
    assert rejected({"controls": []}).reason == "unknown_type"
    assert rejected({"version": 1, "payload": {}}).reason == "unknown_type"


@pytest.mark.parametrize(
    "message",
    [
        {"type": "control_state"},
        {"type": "control_state", "controls": "w"},
        {"type": "control_state", "controls": None},
        {"type": "control_state", "controls": {"w": True}},
        {"type": "control_state", "controls": ["w", 1]},
        {"type": "control_state", "controls": [["w"]]},
        {"type": "control"},
        {"type": "control", "control": 3},
        {"type": "control", "control": None, "key": "w"},
        {"type": "control", "key": ["w"]},
    ],
)
def test_bad_controls(message: dict[str, Any]) -> None:
    assert rejected(message).reason == "bad_controls"


@pytest.mark.parametrize(
    "message",
    [
        {"type": "control_state", "controls": ["w", "z"]},
        {"type": "control_state", "controls": [""]},
        {"type": "control", "control": "W"},
        {"type": "control", "key": "space", "event": "press"},
        {"type": "control", "control": "KeyQ", "event": "reset"},
    ],
)
def test_unknown_control(message: dict[str, Any]) -> None:
    assert rejected(message).reason == "unknown_control"


@pytest.mark.parametrize(
    "controls", [["w", "w"], ["w", "ArrowUp"], ["forward", "KeyW"], ["a", "j", "left"], ["down", "backward"]]
)
def test_duplicate_control(controls: list[str]) -> None:
    assert rejected({"type": "control_state", "controls": controls}).reason == "duplicate_control"


@pytest.mark.parametrize(("message", "meant"), [
    ({"type": "control", "key": "w", "evnt": "release"}, "event"),  # read as it stands: a press
    ({"type": "control", "keys": "w", "event": "press"}, "key"),
    ({"type": "control_state", "control": ["w"], "controls": []}, "controls"),  # read as it stands: nothing held
    ({"type": "prompt", "promt": "night", "prompt": "day"}, "prompt"),
    ({"type": "delivery_ack", "received_frame": 3}, "received_frames"),
    ({"type": "stop", "sesion_id": "s1"}, "session_id"),
    ({"version": 1, "type": "control", "payload": {"key": "w"}, "sesion_id": "s1"}, "session_id"),
])
def test_a_near_miss_of_a_field_the_message_reads_is_refused_naming_it(message: dict[str, Any], meant: str) -> None:
    """Unknown fields are ignored, but one a letter away from a field the message reads was read as the message
    without it: a misspelt ``event`` turned a release into a press."""
    failure = rejected(message)
    assert failure.reason == "misspelt_field" and f"did you mean {meant!r}" in failure.detail, failure


def test_other_unknown_fields_are_ignored() -> None:
    """Clients add their own (timestamps, counters, ids): those are not near misses and change nothing."""
    extras = {"timestamp": 1.5, "seq": 7, "id": "abc", "client": "web", "ts": 3}
    assert parse({"type": "control", "key": "w", "event": "release", **extras}).pressed is False
    assert parse({"type": "control_state", "controls": ["w"], **extras}).keys == frozenset({"w"})


@pytest.mark.parametrize("event", ["keydown", "hold", "", None, 1, ["press"], "reset pose"])
def test_unknown_event(event: Any) -> None:
    assert rejected({"type": "control", "control": "w", "event": event}).reason == "unknown_event"
    assert rejected({"type": "control", "control": "w", "action": event}).reason == "unknown_event"


@pytest.mark.parametrize(("message", "named"), [
    ({"type": "control", "control": "w", "key": "s"}, "'control' names key 'w' and 'key' names 's'"),
    ({"type": "control", "control": "j", "event": "press", "action": "release"}, "'event' 'press' and 'action'"),
    ({"type": "control", "key": "w", "event": "reset", "action": "press"}, "'event' 'reset' and 'action'"),
    ({"version": 1, "type": "control", "payload": {"key": "ArrowUp", "control": "down"}}, "names key 's'"),
])
def test_fields_that_say_two_things_are_refused_naming_both(message: dict[str, Any], named: str) -> None:
    """``control`` beside ``key`` (or ``event`` beside ``action``) saying something else was taken silently, one of
    them ignored: the sender meant one of the two, and which one is a guess."""
    failure = rejected(message)
    assert failure.reason == "conflicting_fields" and named in failure.detail, failure


@pytest.mark.parametrize("message", [
    {"type": "control", "control": "w", "key": "KeyW", "event": "release", "action": "keyup"},
    {"type": "control", "control": "ArrowLeft", "key": "left", "event": "PRESS", "action": "press"},
])
def test_fields_that_say_the_same_thing_twice_are_taken(message: dict[str, Any]) -> None:
    control = parse(message)
    assert control.key in ("w", "a") and control.pressed == (message["event"].lower() == "press")


@pytest.mark.parametrize("claimed", [{"session_id": "other"}, {"session_id": "s1", "payload_session": "other"}])
def test_an_envelope_whose_payload_names_another_session_is_refused(claimed: dict[str, Any]) -> None:
    """The payload's ``session_id`` was never checked: an envelope naming another session there was applied (the
    same id at the top level is refused)."""
    payload = {"controls": ["a"], "session_id": claimed.get("payload_session", claimed["session_id"])}
    top = {"session_id": "s1"} if "payload_session" in claimed else {}
    assert rejected({"version": 1, "type": "control_state", "payload": payload, **top}).reason == "wrong_session"


@pytest.mark.parametrize("prompt", [None, "", "   ", "\n\t", 5, ["a"], "x" * 2001])
def test_bad_prompt(prompt: Any) -> None:
    assert rejected({"type": "prompt", "prompt": prompt}).reason == "bad_prompt"


def test_missing_prompt() -> None:
    assert rejected({"type": "prompt"}).reason == "bad_prompt"


def test_validation_order() -> None:
    # Each earlier check wins over every later one.
    bad = b'{"version": 2, "type": "nope"}'
    assert rejected(bad, topic="tf.status", sender_identity="").reason == "server_topic"
    assert rejected(bad, topic="tf.other", sender_identity="").reason == "wrong_topic"
    assert rejected(b"x" * 20000, sender_identity="intruder").reason == "not_controller"
    assert rejected(b"{" * 20000).reason == "too_large"
    assert rejected(b"[1,").reason == "invalid_json"
    assert rejected(bad).reason == "bad_version"
    assert rejected({"version": 1, "session_id": "x", "payload": [], "type": "nope"}).reason == "wrong_session"
    assert rejected({"version": 1, "payload": [], "type": "nope"}).reason == "bad_payload"
    assert rejected({"version": 1, "payload": {}, "type": "nope"}).reason == "unknown_type"
    assert rejected({"type": "control", "control": "z", "event": "nope"}).reason == "unknown_control"


def test_rejection_carries_reason_and_detail() -> None:
    failure = rejected({"type": "control_state", "controls": ["w", "z" * 500]})
    assert isinstance(failure, ValueError)
    assert failure.reason == "unknown_control"
    # cut, never all of it; the known names follow
    assert "(500 characters in all)" in failure.detail and len(failure.detail) < 2 * MAX_ECHO + len(KNOWN_CONTROLS)
    assert failure.detail.endswith(f"; {KNOWN_CONTROLS}")
    assert str(failure).startswith("unknown_control: ")
    with pytest.raises(ValueError):
        InvalidControl("made_up", "x")


def test_every_reason_is_reachable_by_these_tests() -> None:
    # Keeps the reason table and the tests above in step.
    assert REJECTION_REASONS == {
        "server_topic", "wrong_topic", "not_controller", "too_large", "invalid_json", "not_an_object", "bad_version",
        "wrong_session", "bad_payload", "unknown_type", "bad_controls", "unknown_control",
        "duplicate_control", "unknown_event", "bad_prompt", "misspelt_field", "conflicting_fields",
    }  # fmt: skip

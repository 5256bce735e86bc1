"""The control data protocol (server.protocol) under property tests: any JSON value, near-valid message, bytes or
text is accepted as a known control or refused with a known reason, never an exception; and every control
round-trips through its flat and enveloped forms. (The shapes and refusals one by one: ``test_protocol.py``.)"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.contract import KNOWN_KEYS, Control, ControlType, prompt_problem
from server.protocol import KEY_ALIASES, MESSAGE_TYPES, REJECTION_REASONS, DeliveryAck, InvalidControl

from .protocol_helpers import SESSION, envelope, parse


# -- property tests -----------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
# Strings and values the parser cares about, so random trees reach deep branches.
interesting = st.sampled_from(
    ["type", "version", "payload", "session_id", "controls", "control", "key", "event", "action", "prompt",
     "received_frames", "control_state", "control", "prompt", "reset", "reset_pose", "stop", "delivery_ack",
     "press", "release", "keyup", "end", "w", "ArrowUp", "KeyJ", "left", SESSION, 1]
)  # fmt: skip
json_values = st.recursive(
    json_scalars | interesting,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | interesting.filter(lambda v: isinstance(v, str)), children, max_size=5),
    max_leaves=25,
)

names = st.sampled_from(sorted(KEY_ALIASES)) | st.sampled_from(["W", "z", "", "KeyQ"]) | json_scalars
events = st.sampled_from(["press", "release", "keyup", "end", "reset", "reset_pose", "PRESS", "hold"]) | json_scalars
# Near-valid messages, so the fuzz also reaches every type's own checks and acceptance.
structured = st.fixed_dictionaries(
    {"type": st.sampled_from(sorted(MESSAGE_TYPES)) | json_scalars},
    optional={
        "controls": st.lists(names, max_size=4) | json_values,
        "control": names,
        "key": names,
        "event": events,
        "action": events,
        "prompt": st.text(max_size=30) | json_scalars,
        "received_frames": st.integers(-2, 5) | json_scalars,
        "session_id": st.sampled_from([SESSION, "other", None]),
    },
)


def split_envelope(fields: dict[str, Any]) -> dict[str, Any]:
    payload = {k: v for k, v in fields.items() if k != "type"}
    return {"version": 1, "type": fields.get("type"), "payload": payload}


near_valid = (
    structured
    | structured.map(lambda fields: {"version": 1, "payload": fields})
    | structured.map(split_envelope)
)


def check_outcome(raw: Any) -> None:
    try:
        result = parse(raw)
    except InvalidControl as failure:
        assert failure.reason in REJECTION_REASONS
        assert isinstance(failure.detail, str)
    else:
        assert isinstance(result, Control | DeliveryAck)
        if isinstance(result, Control):
            assert result.keys <= KNOWN_KEYS


@settings(max_examples=400)
@given(json_values)
def test_fuzz_json_values(value: Any) -> None:
    check_outcome(value)
    check_outcome(json.dumps(value))
    check_outcome(json.dumps(value).encode())
    if isinstance(value, dict):
        check_outcome(envelope("control", value))
        check_outcome({"version": 1, "payload": value})


@settings(max_examples=500)
@given(near_valid)
def test_fuzz_near_valid_messages(message: dict[str, Any]) -> None:
    check_outcome(message)
    check_outcome(json.dumps(message).encode())


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_fuzz_bytes(raw: bytes) -> None:
    check_outcome(raw)


@settings(max_examples=200)
@given(st.text(max_size=200))
def test_fuzz_text(raw: str) -> None:
    check_outcome(raw)


# text with no control characters or lone surrogates, and something visible in it: what a prompt may be
prompts = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=2000).filter(
    lambda p: prompt_problem(p) is None)
controls = st.one_of(
    st.builds(
        lambda keys: Control(ControlType.CONTROL_STATE, keys=keys),
        st.frozensets(st.sampled_from(sorted(KNOWN_KEYS))),
    ),
    st.builds(
        lambda key, pressed: Control(ControlType.CONTROL, key=key, pressed=pressed),
        st.sampled_from(sorted(KNOWN_KEYS)),
        st.booleans(),
    ),
    st.builds(lambda prompt: Control(ControlType.PROMPT, prompt=prompt), prompts),
    st.sampled_from([Control(ControlType.RESET), Control(ControlType.RESET_POSE), Control(ControlType.STOP)]),
)


@settings(max_examples=300)
@given(controls)
def test_round_trip(control: Control) -> None:
    flat = control.as_dict()
    assert parse(flat) == control
    assert parse(json.dumps(flat).encode(), max_bytes=1 << 20) == control
    payload = {k: v for k, v in flat.items() if k != "type"}
    assert parse(envelope(flat["type"], payload, session_id=SESSION)) == control

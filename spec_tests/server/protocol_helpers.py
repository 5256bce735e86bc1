"""What the control protocol tests share (``test_protocol.py``, ``test_protocol_fuzz.py``,
``test_protocol_status_messages.py``): a control message parsed as the controller's on the control topic, the
refusal of one, and the JSON and envelope forms a message is sent in.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipelines.contract import Control
from server.protocol import CONTROL_TOPIC, DeliveryAck, InvalidControl, parse_control

CONTROLLER = "controller-1"
SESSION = "sess-1"


def parse(raw: Any, **overrides: Any) -> Control | DeliveryAck:
    kwargs: dict[str, Any] = {
        "topic": CONTROL_TOPIC,
        "sender_identity": CONTROLLER,
        "controller_identity": CONTROLLER,
        "session_id": SESSION,
        **overrides,
    }
    return parse_control(raw, **kwargs)


def rejected(raw: Any, **overrides: Any) -> InvalidControl:
    with pytest.raises(InvalidControl) as info:
        parse(raw, **overrides)
    return info.value


def as_json(message: Any) -> bytes:
    return json.dumps(message).encode()


def envelope(kind: str, payload: Any = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"version": 1, "type": kind, **extra}
    if payload is not None:
        out["payload"] = payload
    return out

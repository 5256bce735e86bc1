"""The status messages the server sends (server.protocol): status, chunk, done, error, control_rejected, lease and
metrics messages with their type on top, extras that cannot shadow the envelope, and data that is not JSON made
into JSON. (The control messages it reads: ``test_protocol.py``.)"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from pipelines.contract import ControlType
from server.protocol import (
    chunk_message,
    done_message,
    error_message,
    lease_message,
    metrics_message,
    rejection_message,
    status_message,
)

from .protocol_helpers import SESSION, rejected


# -- status messages ----------------------------------------------------------


def decode(message: bytes) -> dict[str, Any]:
    assert isinstance(message, bytes)
    return json.loads(message)


def test_status_message() -> None:
    out = decode(status_message(SESSION, "generating", timestamp=12.5, chunk=3, fps=16.0))
    assert out == {
        "type": "status",
        "session_id": SESSION,
        "stage": "generating",
        "data": {"chunk": 3, "fps": 16.0},
        "timestamp": 12.5,
    }


def test_builders_put_the_real_type_on_top() -> None:
    assert decode(chunk_message(SESSION, 4, {"frames": 8}, timestamp=1.0)) == {
        "type": "chunk", "session_id": SESSION, "index": 4, "data": {"frames": 8}, "timestamp": 1.0,
    }  # fmt: skip
    assert decode(done_message(SESSION, 10, 160, reason="stop", timestamp=2)) == {
        "type": "done", "session_id": SESSION, "total_chunks": 10, "published_frames": 160, "reason": "stop",
        "timestamp": 2.0,
    }  # fmt: skip
    assert decode(error_message(SESSION, "pipeline_failed", "boom", timestamp=3)) == {
        "type": "error", "session_id": SESSION, "reason": "pipeline_failed", "detail": "boom", "timestamp": 3.0,
    }  # fmt: skip
    assert decode(rejection_message(SESSION, "unknown_control", "unknown control 'z'", timestamp=4)) == {
        "type": "control_rejected", "session_id": SESSION, "reason": "unknown_control",
        "detail": "unknown control 'z'", "timestamp": 4.0,
    }  # fmt: skip
    assert decode(lease_message(SESSION, "lease_queued", 2, timestamp=5)) == {
        "type": "lease_queued", "session_id": SESSION, "queue_position": 2, "timestamp": 5.0,
    }  # fmt: skip
    assert decode(lease_message(SESSION, "lease_granted", None, timestamp=5))["queue_position"] is None
    with pytest.raises(ValueError, match="unknown lease event"):
        lease_message(SESSION, "granted", None)
    assert decode(metrics_message(SESSION, timestamp=6, real_time_factor=0.5, period=None)) == {
        "type": "metrics", "session_id": SESSION, "data": {"real_time_factor": 0.5, "period": None}, "timestamp": 6.0,
    }  # fmt: skip


def test_extras_cannot_shadow_the_envelope_fields() -> None:
    out = decode(status_message(SESSION, "x", timestamp=1, type="chunk", stage="y", session_id="z"))
    assert (out["type"], out["stage"], out["session_id"]) == ("status", "x", SESSION)
    assert out["data"] == {"type": "chunk", "stage": "y", "session_id": "z"}
    out = decode(metrics_message(SESSION, timestamp=1, type="status", session_id="z"))
    assert (out["type"], out["session_id"], out["data"]) == ("metrics", SESSION, {"type": "status", "session_id": "z"})


def test_default_timestamp_is_now() -> None:
    import time

    before = time.time()
    stamp = decode(done_message(SESSION, 0, 0))["timestamp"]
    assert before <= stamp <= time.time()


def test_non_json_values_are_stringified() -> None:
    class Opaque:
        def __str__(self) -> str:
            return "opaque!"

    data: Mapping[str, Any] = MappingProxyType(
        {
            "obj": Opaque(),
            "np_int": np.int64(7),
            "np_float": np.float32(0.5),
            "nan": math.nan,
            "inf": float("inf"),
            "keys": frozenset({"w", "a"}),
            "tuple": (1, "x"),
            "enum": ControlType.STOP,
            "bytes": b"\x00",
            3: "int key",
            "nested": {"deeper": [Opaque()]},
        }
    )
    out = decode(chunk_message(SESSION, 0, data, timestamp=0))["data"]
    assert out == {
        "obj": "opaque!",
        "np_int": 7,
        "np_float": 0.5,
        "nan": "nan",
        "inf": "inf",
        "keys": ["a", "w"],
        "tuple": [1, "x"],
        "enum": str(ControlType.STOP),
        "bytes": str(b"\x00"),
        "3": "int key",
        "nested": {"deeper": ["opaque!"]},
    }


def test_cyclic_data_does_not_recurse_forever() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    out = decode(status_message(SESSION, "x", timestamp=0, loop=loop))
    assert out["type"] == "status"


def test_rejection_round_trip_to_a_message() -> None:
    failure = rejected({"type": "prompt", "prompt": ""})
    out = decode(rejection_message(SESSION, failure.reason, failure.detail, timestamp=0))
    assert (out["type"], out["reason"]) == ("control_rejected", "bad_prompt")

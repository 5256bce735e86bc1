"""Shared helpers of the bad-input tests (spec_tests/security).

- :func:`assert_error_body`: every refusal of the HTTP API is exactly ``{"error", "detail"}`` JSON with a
  non-empty code and detail;
- :func:`check_runtime_invariants`: what must hold between any two requests, whatever they carried;
- :func:`run_hypothesis_in_thread`: one started app serves every Hypothesis example. pytest-trio would run
  each example of an ``async`` ``@given`` test in a fresh ``trio.run`` (a fresh app and worker per example);
  instead the examples run in a worker thread and call back into the test's trio loop with
  ``trio.from_thread.run``, so state (sessions, rooms, metrics) accumulates across examples as on a real server.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypothesis import HealthCheck, settings

from server.runtime import StreamRuntime
from states.stream_session import State

__all__ = [
    "ALLOWED_STATUSES",
    "FUZZ_SETTINGS",
    "assert_error_body",
    "check_runtime_invariants",
    "decode_json",
    "run_hypothesis_in_thread",
]

#: every status the HTTP API may answer a client request with (no 5xx, ever)
# 405: a session id containing "/" (e.g. %2F) routes to another path whose method differs;
# it is refused with a JSON reason like any other 4xx
ALLOWED_STATUSES = frozenset({200, 202, 400, 404, 405, 409, 413, 429})

FUZZ_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    database=None,  # no .hypothesis/ directory in the checkout
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def assert_error_body(status: int, raw: bytes, what: str = "") -> dict[str, str]:
    body = decode_json(raw)
    assert isinstance(body, dict), f"{what}: HTTP {status} body is not a JSON object: {raw[:300]!r}"
    assert set(body) == {"error", "detail"}, f"{what}: HTTP {status} error body has keys {sorted(body)}"
    assert isinstance(body["error"], str) and body["error"], f"{what}: empty error code: {body!r}"
    assert isinstance(body["detail"], str) and body["detail"].strip(), f"{what}: empty detail: {body!r}"
    return body


def check_response(status: int, raw: bytes, content_type: str | None, what: str) -> Any:
    """The common contract: an allowed status, JSON, and the error shape on every 4xx."""
    assert status in ALLOWED_STATUSES, f"{what}: HTTP {status} {raw[:500]!r}"
    assert content_type is not None and content_type.startswith("application/json"), (
        f"{what}: HTTP {status} content type {content_type!r}"
    )
    if status >= 400:
        return assert_error_body(status, raw, what)
    body = decode_json(raw)
    assert isinstance(body, dict), f"{what}: HTTP {status} body is not a JSON object: {raw[:300]!r}"
    return body


def check_runtime_invariants(runtime: StreamRuntime) -> None:
    """No record is left half-admitted, no worker holds more than its capacity, the queue stays in bounds."""
    records = list(runtime.registry)
    pending = [r.session_id for r in records if r.status is State.PENDING]
    assert not pending, f"records left in 'pending': {pending}"
    snapshot = runtime.book.snapshot()
    capacity = sum(w.capacity for w in runtime.book.workers())
    assert snapshot.retained <= capacity, f"{snapshot.retained} retained sessions on a capacity of {capacity}"
    assert snapshot.queued <= runtime.settings.queue_size, (
        f"{snapshot.queued} queued sessions with queue_size {runtime.settings.queue_size}"
    )
    live = [r for r in records if not r.is_terminal and r.status is not State.QUEUED]
    assert len(live) <= capacity, f"{len(live)} live sessions on a capacity of {capacity}"
    queued = [r for r in records if r.status is State.QUEUED]
    assert len(queued) == snapshot.queued, (len(queued), snapshot.queued)
    # uploaded images live exactly as long as their session: none is left behind by a refused or ended one
    uploads = runtime.uploads.path
    if uploads is not None:
        on_disk = {os.path.join(uploads, name) for name in os.listdir(uploads)}
        owned = {r.upload_path for r in records if r.upload_path is not None}
        assert on_disk == owned, f"upload files {sorted(on_disk - owned)} belong to no live session"
        assert all(not r.is_terminal for r in records if r.upload_path is not None)


async def run_hypothesis_in_thread(test: Callable[[Callable[..., Awaitable[Any]]], None]) -> None:
    """Run a synchronous Hypothesis test in a worker thread; it reaches trio through the ``call`` it is given.

    ``test(call)`` is expected to be decorated with ``@given``; ``call(async_fn, *args)`` runs ``async_fn`` in
    this trio loop and returns its result (exceptions propagate to Hypothesis, which shrinks them).
    """

    def call(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args)

    await trio.to_thread.run_sync(test, call)

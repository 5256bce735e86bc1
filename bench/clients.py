"""Shared pieces of the server benchmarks: the real server in-process, a WebSocket room client, small stats.

- :func:`running_server` serves ``create_app(settings)`` with hypercorn's trio ``serve`` on ``127.0.0.1:0``
  (the same way ``chunkline stream-serve`` does) and yields once the runtime is ready;
- :class:`RoomClient` is a minimal client of the local rooms' WebSocket (wsproto over a trio socket, as
  ``spec_tests/reliability/helpers.RawWebSocket``), with a send lock so that a heartbeat task and the reader
  may share one socket; :func:`open_controller` creates a session and joins its room as the controller;
- :func:`percentile` (nearest rank on sorted data) and :func:`toy_service` (the in-process toy world service of
  ``worker-0``, for its slot pool).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from server.app import create_app
from server.settings import ServerSettings
from server.transport.client import RoomClient

__all__ = [
    "RoomClient",
    "Served",
    "control_state",
    "ms",
    "open_controller",
    "percentile",
    "running_server",
    "toy_service",
]

SESSIONS = "/v1/stream/sessions"
READY_DEADLINE = 120.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ms(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value * 1000.0, digits)


class Served:
    def __init__(self, app: Any, base_url: str) -> None:
        self.app = app
        self.base_url = base_url
        host_port = base_url.split("://", 1)[1]
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)

    @property
    def runtime(self) -> Any:
        return self.app.extensions["chunkline"]


def toy_service(served: Served) -> Any:
    return served.runtime.workers["worker-0"].service


@contextlib.asynccontextmanager
async def running_server(settings: ServerSettings, **app_options: Any) -> AsyncIterator[Served]:
    app = create_app(settings, **app_options)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 5.0
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(hypercorn_serve, app, config, shutdown_trigger=stop.wait))
        served = Served(app, urls[0])
        served.runtime.serving_at(urls[0])
        with trio.fail_after(READY_DEADLINE):
            while not served.runtime.ready:
                await trio.sleep(0.05)
        try:
            yield served
        finally:
            close_clients = getattr(served.runtime.transport, "close_clients", None)
            if close_clients is not None:
                close_clients()
            stop.set()  # hypercorn shuts down; after_serving drains the runtime


def control_state(keys: Sequence[str]) -> dict[str, Any]:
    return {"topic": "tf.control", "payload": {"type": "control_state", "controls": list(keys)}}


async def open_controller(client: httpx.AsyncClient, served: Served, identity: str,
                          config: dict[str, Any] | None = None) -> tuple[str, RoomClient]:
    """POST a session and join its room as the controller; returns (session_id, socket)."""
    body: dict[str, Any] = {"identity": identity}
    if config:
        body["config"] = config
    response = await client.post(SESSIONS, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"create session: HTTP {response.status_code} {response.text}")
    created = response.json()
    socket = await RoomClient.connect(served.host, served.port, f"{created['websocket_path']}?token={created['token']}")
    return created["session_id"], socket


def now() -> float:
    """Wall clock, comparable with the server's ``time.time()`` stamps (same process)."""
    return time.time()

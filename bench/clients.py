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
import json
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


class RoomClient:
    """A local-room WebSocket client: text messages are dicts, media messages bytes (``b"V"`` + JPEG)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        from wsproto import ConnectionType, WSConnection

        self._stream = stream
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._pending: list[Any] = []
        self._send_lock = trio.Lock()
        self.closed = False

    @classmethod
    async def connect(cls, host: str, port: int, target: str) -> RoomClient:
        from wsproto.events import AcceptConnection, RejectConnection, Request

        stream = await trio.open_tcp_stream(host, port)
        client = cls(stream)
        await client._send(Request(host=f"{host}:{port}", target=target))
        while True:
            event = await client._next_event()
            if isinstance(event, AcceptConnection):
                return client
            if isinstance(event, RejectConnection) or event is None:
                await stream.aclose()
                raise ConnectionError(f"WebSocket {target} refused: {event!r}")
            client._pending.append(event)

    async def _send(self, event: Any) -> None:
        async with self._send_lock:
            await self._stream.send_all(self._ws.send(event))

    async def _next_event(self) -> Any:
        while True:
            for event in self._ws.events():
                return event
            data = await self._stream.receive_some(262144)
            if not data:
                self._ws.receive_data(None)
                for event in self._ws.events():
                    return event
                return None
            self._ws.receive_data(data)

    async def send_json(self, message: Any) -> None:
        from wsproto.events import TextMessage

        await self._send(TextMessage(data=json.dumps(message)))

    async def receive(self) -> Any:
        """The next whole message (dict for text, bytes for media), or None once the server closed."""
        from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

        text: list[str] = []
        binary: list[bytes] = []
        while True:
            event = self._pending.pop(0) if self._pending else await self._next_event()
            if event is None:
                self.closed = True
                return None
            if isinstance(event, CloseConnection):
                self.closed = True
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await self._send(event.response())
                return None
            if isinstance(event, Ping):
                await self._send(event.response())
            elif isinstance(event, TextMessage):
                text.append(event.data)
                if event.message_finished:
                    return json.loads("".join(text))
            elif isinstance(event, BytesMessage):
                binary.append(bytes(event.data))
                if event.message_finished:
                    return b"".join(binary)

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self._stream.aclose()


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

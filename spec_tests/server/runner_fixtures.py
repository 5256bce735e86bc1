"""Helpers for the room-runner tests (server.runner over the local transport, in-process).

- :class:`CounterService`: a tiny async BidirectionalService with no threads. Frame ``n`` of a
  session is a flat grey of :func:`frame_level` ``(n)``; every chunk reports the held keys. It can
  hold ``create_session`` on a gate and stall before chosen chunks, and it records every control
  it was given and every session it closed; :meth:`CounterSession.wait_for` waits for a control to land.
- :func:`no_threads`: a fixture that runs ``trio.to_thread.run_sync`` inline, so that the JPEG
  encoder of the local transport (and the worker's loader) never leave the trio thread. Under
  ``autojump_clock`` a task waiting on a thread counts as blocked, and the clock would jump to the
  next deadline while the encoder works; inline, virtual time moves only when the test or the
  runner sleeps.
- :func:`serve`: a started app, its test client and runtime; live sessions are deleted at the end.
- :class:`Peer`: one WebSocket participant (controller or viewer) whose messages are collected
  by a reader task with the trio time of their arrival.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from quart.testing.connections import WebsocketDisconnectError, WebsocketResponseError
from trio.testing import wait_all_tasks_blocked

from pipelines.contract import (
    BidirectionalService,
    Chunk,
    Control,
    ControlRejected,
    ControlType,
    SessionConfig,
)
from server.app import create_app
from server.runtime import StreamRuntime
from server.settings import ServerSettings

from .client_socket import client_of

LIVEKIT_KEY = "runner-test-key"
LIVEKIT_SECRET = "runner-test-secret-0123456789abcdef-0123456789"  # >= 32 bytes
WORKER_IDENTITY = "chunkline-worker-0"
WALL_DEADLINE = 20.0  # wall seconds a real-time wait may take (toy world threads)

TOY_WARMUP_WARNING = (
    "ignore:Async generator 'pipelines.toy_world.service.ToyWorldService.chunks' was garbage collected:ResourceWarning"
)


# -- the in-test service ---------------------------------------------------------------


def frame_level(n: int) -> int:
    """The grey level of a session's frame ``n`` (JPEG keeps a flat grey within a few levels)."""
    return 20 + (n * 40) % 220


def level_of(jpeg: bytes) -> float:
    return float(decode_jpeg(jpeg).mean())


@attrs.define
class CounterSession:
    session_id: str
    config: SessionConfig
    held: set[str] = attrs.Factory(set)
    controls: list[Control] = attrs.Factory(list)
    stopping: bool = False
    closed: bool = False
    frames_made: int = 0
    chunks_made: int = 0
    changed: trio.Event = attrs.Factory(trio.Event)
    iterator_closed: bool = False  # the chunks iterator was closed (aclose) or exhausted
    iterator_closed_before_close_session: bool | None = None

    async def wait_for(self, predicate: Callable[[CounterSession], bool]) -> None:
        """Wait until ``predicate(self)`` holds, woken by each control the session takes in (``changed``):
        no polling; the caller bounds the wait (``trio.fail_after``)."""
        while not predicate(self):
            await self.changed.wait()


class CounterService(BidirectionalService):
    """Chunks of flat grey frames drawn from a counter, back to back, with no threads."""

    def __init__(
        self,
        *,
        fps: float = 10.0,
        frames_per_chunk: int = 4,
        size: tuple[int, int] = (16, 16),
        chunk_delay: float = 0.0,
        stalls: dict[int, float] | None = None,
        max_chunks: int | None = None,
        close_delay: float = 0.0,
        metadata: dict[str, Any] | None = None,
        leave_delay: float = 0.0,
    ) -> None:
        self.fps = fps
        self.close_delay = close_delay  # trio seconds close_session takes
        self.leave_delay = leave_delay  # trio seconds leaving running() takes, whatever cancels it
        self.metadata = dict(metadata or {})  # extra keys every chunk's metadata carries
        self.frames_per_chunk = frames_per_chunk
        self.size = size
        self.chunk_delay = chunk_delay  # trio seconds to make each chunk
        self.stalls = dict(stalls or {})  # chunk index -> extra trio seconds before it
        self.max_chunks = max_chunks
        self.create_gate: trio.Event | None = None  # create_session waits for it when set
        self.creating = trio.Event()  # set when create_session was entered
        self.sessions: dict[str, CounterSession] = {}
        self.closed: list[str] = []
        self._next = 0

    @asynccontextmanager
    async def running(self) -> AsyncIterator[CounterService]:
        yield self
        if self.leave_delay:
            with trio.CancelScope(shield=True):  # a teardown that waits on its sessions' resources
                await trio.sleep(self.leave_delay)  # bench-cost: the configured teardown (virtual under autojump)

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        self.creating.set()
        if self.create_gate is not None:
            await self.create_gate.wait()
        self._next += 1
        session_id = f"counter-{self._next}"
        self.sessions[session_id] = CounterSession(session_id, config)
        return session_id

    async def push_control(self, session_id: str, control: Control) -> None:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise ControlRejected(f"unknown session {session_id!r}")
        if session.stopping:
            raise ControlRejected("the session is stopping")
        session.controls.append(control)
        if control.type is ControlType.CONTROL_STATE:
            session.held = set(control.keys)
        elif control.type is ControlType.CONTROL:
            assert control.key is not None
            (session.held.add if control.pressed else session.held.discard)(control.key)
        elif control.type is ControlType.RESET:
            session.held.clear()
        elif control.type is ControlType.STOP:
            session.stopping = True
        session.changed.set()
        session.changed = trio.Event()

    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        # A class, not an async generator: whether the runner closes it is observable
        # (``CounterSession.iterator_closed``) and an abandoned one is not a GC warning.
        return _CounterChunks(self, self.sessions[session_id])

    async def close_session(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            return
        if self.close_delay:
            await trio.sleep(self.close_delay)  # bench-cost: close_session's configured work time (virtual under autojump)
        session.closed = True
        session.iterator_closed_before_close_session = session.iterator_closed
        self.closed.append(session_id)


class _CounterChunks:
    def __init__(self, service: CounterService, session: CounterSession) -> None:
        self._service = service
        self._session = session
        self._index = 0

    def __aiter__(self) -> _CounterChunks:
        return self

    async def __anext__(self) -> Chunk:
        service, session = self._service, self._session
        if session.stopping or session.closed or session.iterator_closed:
            session.iterator_closed = True
            raise StopAsyncIteration
        if service.max_chunks is not None and self._index >= service.max_chunks:
            session.iterator_closed = True
            raise StopAsyncIteration
        delay = service.chunk_delay + service.stalls.get(self._index, 0.0)
        if delay:
            await trio.sleep(delay)  # bench-cost: the chunk's configured work time (virtual under autojump)
        else:
            await trio.lowlevel.checkpoint()
        height, width = service.size
        first = session.frames_made
        frames = np.empty((service.frames_per_chunk, height, width, 3), dtype=np.uint8)
        for t in range(service.frames_per_chunk):
            frames[t] = frame_level(first + t)
        session.frames_made += service.frames_per_chunk
        session.chunks_made += 1
        chunk = Chunk(
            index=self._index,
            frames=frames,
            fps=service.fps,
            applied_controls={"keys": sorted(session.held)},
            metadata={"first_frame": first, **service.metadata},
        )
        self._index += 1
        return chunk

    async def aclose(self) -> None:
        self._session.iterator_closed = True


def counter_loader(service: Any) -> Callable[..., Any]:
    def load(path: str, **_: Any) -> Any:
        return service

    return load


@pytest.fixture
def no_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trio.to_thread.run_sync`` runs the function inline (see the module docstring)."""

    async def inline(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", inline)


# -- the app ----------------------------------------------------------------------------


def settings(**overrides: Any) -> ServerSettings:
    """Known LiveKit credentials (they sign the tokens: tests mint expired/forged ones), local media."""
    values: dict[str, Any] = {
        "pipeline": "in-test",
        "max_sessions_per_worker": 1,
        "queue_size": 1,
        "controller_timeout": 3600,
        "room_empty_timeout": 3600,
        "skip_validation": True,  # the startup check has its own tests (test_validation.py)
        "livekit_url": "ws://127.0.0.1:7880",
        "livekit_api_key": LIVEKIT_KEY,
        "livekit_api_secret": LIVEKIT_SECRET,
        "transport": "local",
    }
    values.update(overrides)
    if values.get("workers") == "external":  # its agents run their own check: the option is refused there
        del values["skip_validation"]
    return ServerSettings(**values)


@attrs.define
class Served:
    app: Any
    client: Any
    runtime: StreamRuntime

    async def json(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        response = await getattr(self.client, method)(path, **kwargs)
        body = await response.get_data()
        return response.status_code, (json.loads(body) if body else None)

    async def create(self, identity: str = "ctl", **fields: Any) -> dict[str, Any]:
        status, body = await self.json("post", "/v1/stream/sessions", json={"identity": identity, **fields})
        assert status in (200, 202), (status, body)
        return body

    async def get(self, session_id: str) -> dict[str, Any]:
        status, body = await self.json("get", f"/v1/stream/sessions/{session_id}")
        assert status == 200, (status, body)
        return body

    async def viewer_token(self, session_id: str, identity: str = "viewer-1") -> str:
        status, body = await self.json("post", f"/v1/stream/sessions/{session_id}/tokens", json={"identity": identity})
        assert status == 200, (status, body)
        assert body["role"] == "viewer"
        return body["token"]

    async def metrics_text(self) -> str:
        response = await self.client.get("/v1/service/metrics")
        assert response.status_code == 200
        return (await response.get_data()).decode()

    def free_slots(self) -> int:
        return self.runtime.health()["free_slots"]


async def wait_until(predicate: Callable[[], bool], what: str, deadline: float = WALL_DEADLINE) -> None:
    """Wait for state that threads produce (toy world); bounded by wall-clock time."""
    give_up = time.monotonic() + deadline
    while True:
        await wait_all_tasks_blocked()
        if predicate():
            return
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.sleep(0.002)  # bench-cost: real-time wait for the model's load thread, bounded


@asynccontextmanager
async def serve(
    settings: ServerSettings, service: Any, *, restart_policy: Any = None, ready: bool = True
) -> AsyncIterator[Served]:
    loader = service if callable(service) and not hasattr(service, "running") else counter_loader(service)
    app = create_app(settings, service_loader=loader, restart_policy=restart_policy)
    runtime: StreamRuntime = app.extensions["chunkline"]
    async with app.test_app() as test_app:
        served = Served(app, client_of(test_app), runtime)
        if ready:
            await wait_until(lambda: runtime.ready, "the runtime to be ready")
        try:
            yield served
        finally:
            for record in list(runtime.registry):
                if not record.is_terminal:
                    with trio.move_on_after(5):
                        await runtime.delete_session(record.session_id)
            await wait_all_tasks_blocked()


# -- participants -------------------------------------------------------------------------


@attrs.define(eq=False)
class Received:
    at: float  # trio clock
    message: Any  # dict (text) or bytes (media)


class Peer:
    """One WebSocket participant: a reader task collects every message with its arrival time."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.inbox: list[Received] = []
        self.closed_with: Exception | None = None
        self._arrived = trio.Event()
        self.reader_done = trio.Event()

    async def _read(self) -> None:
        try:
            while True:
                raw = await self.ws.receive()
                message = json.loads(raw) if isinstance(raw, str) else raw
                self.inbox.append(Received(trio.current_time(), message))
                self._arrived.set()
                self._arrived = trio.Event()
        except (WebsocketDisconnectError, WebsocketResponseError, trio.EndOfChannel, trio.ClosedResourceError) as exc:
            self.closed_with = exc
        finally:
            self.reader_done.set()
            self._arrived.set()

    async def send(self, topic: str, payload: Any) -> None:
        await self.ws.send(json.dumps({"topic": topic, "payload": payload}))

    async def control(self, payload: Any) -> None:
        await self.send("tf.control", payload)

    # views of the inbox
    def texts(self) -> list[dict[str, Any]]:
        return [r.message for r in self.inbox if isinstance(r.message, dict)]

    def frames(self) -> list[Received]:
        return [r for r in self.inbox if isinstance(r.message, bytes) and r.message[:1] == b"V"]

    def status(self, kind: str | None = None) -> list[dict[str, Any]]:
        out = [m["payload"] for m in self.texts() if m.get("type") == "data" and m.get("topic") == "tf.status"]
        return out if kind is None else [p for p in out if p.get("type") == kind]

    def stages(self) -> list[str]:
        return [p["stage"] for p in self.status("status")]

    async def wait_for(self, predicate: Callable[[Peer], Any], what: str, timeout: float = 30.0) -> Any:
        """Wait (trio time; under autojump virtual) until ``predicate(self)`` is truthy; returns it."""
        with trio.move_on_after(timeout):
            while True:
                found = predicate(self)
                if found:
                    return found
                if self.reader_done.is_set():
                    break
                await self._arrived.wait()
        found = predicate(self)
        if found:
            return found
        raise AssertionError(f"timed out waiting for {what}; got {[m for m in self.texts()][-8:]}")


@asynccontextmanager
async def join(served: Served, room: str, token: str | None) -> AsyncIterator[Peer]:
    """Connect a participant (``token`` None: with no token at all); its reader runs until the block ends
    (the socket is then closed)."""
    async with join_at(served, f"/v1/rooms/{room}/ws", token) as peer:
        yield peer


@asynccontextmanager
async def join_at(served: Served, path: str, token: str | None) -> AsyncIterator[Peer]:
    """:func:`join` at the room socket ``path`` (a ``websocket_path`` an answer of the API names)."""
    query = "" if token is None else f"?token={token}"
    async with served.client.websocket(f"{path}{query}") as ws:
        peer = Peer(ws)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer._read)
            try:
                yield peer
            finally:
                nursery.cancel_scope.cancel()


def decode_jpeg(jpeg: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(jpeg)) as container:
        frame = next(container.decode(video=0))
        return frame.to_ndarray(format="rgb24")


def make_issuer(*, secret: str = LIVEKIT_SECRET, clock: Callable[[], float] = time.time) -> Any:
    from server.tokens import TokenIssuer

    return TokenIssuer(LIVEKIT_KEY, secret, 3600.0, clock=clock)

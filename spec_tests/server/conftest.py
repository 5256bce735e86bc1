"""Shared fixtures and helpers for the HTTP API tests (server.app, server.runtime).

Apps are built with a tiny toy world (32x48, 2 frames per chunk) so a worker is
ready in a few milliseconds. Sessions in these tests have no controller: with a
large ``controller_timeout`` / ``room_empty_timeout`` their runners wait in
``joining_room`` until the test deletes them or the session timeout fires.

A test that takes ``worker_kind`` (or ``served``) runs twice: ``in-process`` (the app on quart's test
client, its worker in the process) and ``local-agents`` (the same settings with ``--workers local``,
served over HTTP, the worker an agent process; see :mod:`.http_served`). A test that cannot apply
to agents says why with ``@pytest.mark.in_process_only(reason=...)`` and runs ``in-process`` only.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from pipelines.toy_world import ToyWorldConfig, ToyWorldService
from server.app import create_app
from server.runtime import StreamRuntime
from server.settings import ServerSettings

from .client_socket import client_of
from .http_served import AgentApp, AgentApps, HttpClient, agent_settings

PIPELINE = "pipelines/toy_world"
READY_DEADLINE = 20.0  # wall seconds a toy worker may take to load (it takes ~30 ms)


LIVEKIT_KEY = "lk-test-key"
LIVEKIT_SECRET = "lk-test-secret-0123456789abcdef-0123456789"  # >= 32 bytes
API_KEY = "api-key-do-not-leak-7f3a9c"


def png_bytes(width: int = 4, height: int = 4) -> bytes:
    """A valid RGB PNG, written by hand (signature, IHDR, IDAT, IEND)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    # each row: filter byte 0, then width RGB pixels
    raw = b"".join(
        b"\x00" + b"".join(bytes([(x * 50) % 256, (y * 60) % 256, 128]) for x in range(width)) for y in range(height)
    )
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def toy_loader(max_sessions: int = 4) -> Callable[..., ToyWorldService]:
    def load(path: str, **_: Any) -> ToyWorldService:
        return ToyWorldService(ToyWorldConfig(height=32, width=48, frames_per_chunk=2), max_sessions=max_sessions)

    return load


def failing_loader(path: str, **_: Any) -> Any:
    raise RuntimeError("the model file is missing (test)")


class GatedLoader:
    """A toy loader that blocks (in the worker's loading thread) until ``release()``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._inner = toy_loader()

    def __call__(self, path: str, **kw: Any) -> ToyWorldService:
        self.entered.set()
        if not self.gate.wait(timeout=READY_DEADLINE):
            raise RuntimeError("gate never released")
        return self._inner(path, **kw)

    def release(self) -> None:
        self.gate.set()


WORKERS = ("in-process", "local-agents")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "worker_kind" in metafunc.fixturenames:
        only = metafunc.definition.get_closest_marker("in_process_only")
        if only is not None:
            assert only.kwargs.get("reason"), f"{metafunc.definition.name}: in_process_only needs a reason"
        metafunc.parametrize("worker_kind", ["in-process"] if only else list(WORKERS), indirect=True)


@pytest.fixture(scope="module")
def agent_apps() -> Iterator[AgentApps]:
    """The module's ``--workers local`` apps (agents take seconds to start: tests share them)."""
    apps = AgentApps()
    try:
        yield apps
    finally:
        apps.close()


@pytest.fixture
def worker_kind(request: pytest.FixtureRequest) -> AgentApps | None:
    """None for ``in-process``; the module's agent apps for ``local-agents``."""
    return None if request.param == "in-process" else request.getfixturevalue("agent_apps")


@pytest.fixture(scope="module")
def assets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``assets/scene.png``, ``assets/sub/deep.png``, and ``assets/escape.png`` -> ``../outside.png``.

    Module-scoped: no test writes to it, and a ``local-agents`` app with it is shared by the module."""
    tmp_path = tmp_path_factory.mktemp("assets-root")
    root = tmp_path / "assets"
    (root / "sub").mkdir(parents=True)
    (root / "scene.png").write_bytes(png_bytes())
    (root / "sub" / "deep.png").write_bytes(png_bytes())
    (tmp_path / "outside.png").write_bytes(png_bytes())
    (root / "escape.png").symlink_to(tmp_path / "outside.png")
    (root / "inside_link.png").symlink_to(root / "scene.png")
    return root


def make_settings(**overrides: Any) -> ServerSettings:
    values: dict[str, Any] = {
        "pipeline": PIPELINE,
        "max_sessions_per_worker": 2,
        "queue_size": 2,
        "controller_timeout": 3600,
        "room_empty_timeout": 3600,
        "skip_validation": True,  # the startup check has its own tests (test_validation.py)
    }
    values.update(overrides)
    return ServerSettings(**values)


def livekit_settings(**overrides: Any) -> ServerSettings:
    """LiveKit credentials configured (they sign the tokens), media still on the local transport."""
    values: dict[str, Any] = {
        "livekit_url": "ws://127.0.0.1:7880",
        "livekit_api_key": LIVEKIT_KEY,
        "livekit_api_secret": LIVEKIT_SECRET,
        "transport": "local",
    }
    values.update(overrides)
    return make_settings(**values)


@attrs.define
class Served:
    app: Any
    client: Any
    runtime: StreamRuntime
    settings: ServerSettings
    worker_id: str = "worker-0"  # the one worker (an agent registers under a fresh id)
    agents: AgentApp | None = None  # local-agents: the shared app these requests go to

    async def json(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any, Any]:
        response = await getattr(self.client, method)(path, **kwargs)
        body = await response.get_data()
        try:
            import json as _json

            parsed = _json.loads(body) if body else None
        except ValueError:
            parsed = None
        return response.status_code, parsed, response

    async def create(self, identity: str = "ctl", **fields: Any) -> tuple[int, Any, Any]:
        return await self.json("post", "/v1/stream/sessions", json={"identity": identity, **fields})

    async def settle(self) -> None:
        """Let every task that can run, run (runners advancing, drains finishing); with agents, until
        their progress reached the authority."""
        await wait_all_tasks_blocked()
        if self.agents is not None:
            await self.agents.settle()


async def wait_until(predicate: Callable[[], bool], what: str, deadline: float = READY_DEADLINE) -> None:
    """Wait for runtime state that threads (pipeline loading) produce; bounded by a wall-clock deadline."""
    give_up = time.monotonic() + deadline
    while True:
        await wait_all_tasks_blocked()
        if predicate():
            return
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.to_thread.run_sync(time.sleep, 0.002)  # bench-cost: a loading thread runs outside trio


async def wait_ready(runtime: StreamRuntime) -> None:
    await wait_until(lambda: runtime.ready, "the runtime to be ready")


async def wait_worker_failed(runtime: StreamRuntime) -> None:
    await wait_until(lambda: any(w.failure for w in runtime.workers.values()), "a worker to fail")


@asynccontextmanager
async def serve(
    settings: ServerSettings | None = None,
    *,
    workers: AgentApps | None = None,
    loader: Callable[..., Any] | None = None,
    ready: bool = True,
    cleanup: bool = True,
) -> AsyncIterator[Served]:
    """A started app (lifespan run) and its test client; waits until ready unless ``ready=False``.

    ``cleanup`` deletes live sessions before the lifespan ends, so each test checks its own subject;
    ``test_shutdown_with_live_session`` checks shutdown with live sessions on its own. With ``workers``
    (``local-agents``) the app is the module's shared one for these settings, over HTTP.
    """
    settings = settings or make_settings()
    if workers is not None:
        assert loader is None and ready and cleanup, "an agent loads its own pipeline, and is shared: ready, cleaned up"
        async with serve_agents(workers, settings) as served:
            yield served
        return
    app = create_app(settings, service_loader=loader or toy_loader(settings_capacity(settings)))
    runtime: StreamRuntime = app.extensions["chunkline"]
    async with app.test_app() as test_app:
        served = Served(app, client_of(test_app), runtime, settings)
        if ready:
            await wait_ready(runtime)
        try:
            yield served
        finally:
            if cleanup:
                for record in list(runtime.registry):
                    if not record.is_terminal:
                        with trio.move_on_after(5):
                            await runtime.delete_session(record.session_id)
                await wait_all_tasks_blocked()


@asynccontextmanager
async def serve_agents(apps: AgentApps, settings: ServerSettings) -> AsyncIterator[Served]:
    """The module's ``--workers local`` app for ``settings``, ready and clean, and an HTTP client to it."""
    app = await apps.get(agent_settings(settings))
    try:
        worker_id = await app.wait_clean()
        # keep-alive, as a real client: a 413 closes its own connection and the client opens a new one
        async with httpx.AsyncClient(base_url=app.url or "", timeout=10) as http:
            try:
                yield Served(app.app, HttpClient(http), app.runtime, app.settings, worker_id, app)  # type: ignore[arg-type]
            finally:
                await app.reset()
    except BaseException:
        await apps.discard(app)  # the next test gets a fresh one, not one left in an unknown state
        raise


def settings_capacity(settings: ServerSettings) -> int:
    limit = settings.max_sessions_per_worker
    return limit if isinstance(limit, int) else 4


@pytest.fixture
async def served(worker_kind: AgentApps | None) -> AsyncIterator[Served]:
    async with serve(workers=worker_kind) as s:
        yield s


def assert_error_body(status: int, body: Any, code: str | None = None) -> None:
    assert isinstance(body, dict), f"HTTP {status} body is not a JSON object: {body!r}"
    assert set(body) == {"error", "detail"}, f"HTTP {status} error body keys {sorted(body)}"
    assert isinstance(body["error"], str) and body["error"]
    assert isinstance(body["detail"], str) and body["detail"]
    if code is not None:
        assert body["error"] == code, body


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh folder for the server's TMPDIR, with a path short enough for the Unix socket it makes there (at most
    107 bytes): pytest's tmp_path is longer under a parallel run (each process has a folder of its own in it)."""
    path = Path(tempfile.mkdtemp(prefix="cl-exit-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

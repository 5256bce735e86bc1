"""The real app on a real loopback port, and the ``local-agents`` side of the HTTP tests.

:func:`serve_http` serves an app with hypercorn's trio ``serve`` on ``127.0.0.1:0`` (the load test
and the agent apps below use it). :class:`AgentApps` is the ``local-agents`` parametrization of the
API and admission tests: the app built from the test's settings with ``--workers local`` (its one
worker a ``chunkline worker`` agent process on the tiny toy world), served over HTTP, reached
through :class:`HttpClient`, which answers the way the quart test client does. An agent takes
seconds to start (it imports torch), so one app per distinct settings is shared by a module's tests:
it runs in a thread with a trio loop of its own, and each test leaves it as it found it (live
sessions deleted, slots free, terminal records forgotten). Whatever a test reads of the runtime
while the app runs goes through :meth:`AgentApp.call`, in the app's own loop; a test's plain
attribute reads happen while its requests have settled.
"""

from __future__ import annotations

import json as _json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from server.app import create_app
from server.runtime import StreamRuntime
from server.settings import ServerSettings

from ..reliability.helpers import pid_alive

__all__ = ["AGENT_PIPELINE", "AgentApp", "AgentApps", "HttpClient", "agent_settings", "serve_http"]

AGENT_PIPELINE = "spec_tests/cluster/tiny_world.py"  # the toy world at 32x48, 2 frames a chunk, as toy_loader builds it
AGENT_START = 240.0  # wall seconds: an agent imports torch and builds its model (slow on a loaded 2-core host)
SETTLE_DEADLINE = 30.0  # wall seconds the agent's progress may take to reach the authority
STOP_DEADLINE = 30.0
KEEP_APPS = 6  # agent apps a module keeps running at once (each holds an agent process, ~0.6 GB); the API
# tests go back to their default app after each test with settings of its own: 3 evicted it twice more


@asynccontextmanager
async def serve_http(app: Any) -> AsyncIterator[str]:
    """``app`` served by hypercorn's trio ``serve`` on a free loopback port; yields its base URL."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    stop = trio.Event()
    stopped = trio.Event()

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
        finally:
            stopped.set()

    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(run)
        app.extensions["chunkline"].serving_at(urls[0])  # agents join the local rooms here
        try:
            yield urls[0]
        finally:
            stop.set()
            with trio.fail_after(STOP_DEADLINE):
                await stopped.wait()


def agent_settings(settings: ServerSettings) -> ServerSettings:
    """The test's settings with its one worker an agent: ``--workers local`` on the tiny toy world.

    The heartbeat deadline is generous: liveness is not these tests' subject (``spec_tests/cluster`` tests it)."""
    return attrs.evolve(settings, pipeline=AGENT_PIPELINE, workers="local", num_workers=1, heartbeat_deadline=30.0)


class HttpResponse:
    """What the tests read of a quart test response (``status_code``, ``headers``, ``get_data``)."""

    def __init__(self, response: httpx.Response) -> None:
        self.status_code = response.status_code
        self.headers = response.headers
        self._content = response.content

    async def get_data(self) -> bytes:
        return self._content

    async def get_json(self) -> Any:
        return _json.loads(self._content)


class HttpClient:
    """The quart test client's calls (``json=``, ``data=``, ``headers=``), made over real HTTP."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.http = client

    async def request(self, method: str, path: str, *, data: bytes | None = None, json: Any = None,
                      headers: dict[str, str] | None = None) -> HttpResponse:
        response = await self.http.request(method.upper(), path, content=data, json=json, headers=headers)
        return HttpResponse(response)

    def __getattr__(self, method: str) -> Callable[..., Awaitable[HttpResponse]]:
        if method not in ("get", "post", "put", "patch", "delete", "options", "head"):
            raise AttributeError(method)
        return partial(self.request, method)


class AgentApp:
    """One ``--workers local`` app, served in its own thread and trio loop until :meth:`stop`."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.app: Any = None
        self.runtime: StreamRuntime | None = None
        self.url: str | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._up = threading.Event()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="agent app", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by wait_up/stop, in the test's thread
            self._error = exc
        finally:
            self._up.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        self.app = create_app(self.settings)
        self.runtime = self.app.extensions["chunkline"]
        async with serve_http(self.app) as url:
            self.url = url
            self._up.set()
            await self._stop.wait()

    # -- from the test's trio loop --

    async def call(self, fn: Callable[[StreamRuntime], Any]) -> Any:
        """``fn(runtime)`` run in the app's own loop (the runtime has one owner: that loop)."""
        assert self._token is not None and self.runtime is not None
        return await trio.to_thread.run_sync(partial(trio.from_thread.run_sync, fn, self.runtime, trio_token=self._token))

    async def call_async(self, fn: Callable[[StreamRuntime], Awaitable[Any]]) -> Any:
        assert self._token is not None and self.runtime is not None
        return await trio.to_thread.run_sync(partial(trio.from_thread.run, fn, self.runtime, trio_token=self._token))

    async def until(self, predicate: Callable[[StreamRuntime], Any], what: str, deadline: float) -> Any:
        """Poll ``predicate(runtime)`` in the app's loop until truthy (real time: an agent process does the work)."""
        give_up = time.monotonic() + deadline
        while not (found := await self.call(predicate)):
            if time.monotonic() > give_up:
                raise AssertionError(f"timed out after {deadline:g} s waiting for {what}")
            await trio.sleep(0.005)  # bench-cost: real-time poll of an agent process's progress, bounded by a deadline
        return found

    async def wait_clean(self) -> str:
        """Up, its one agent ready with every slot free, nothing live, no record; returns the worker id."""
        up = await trio.to_thread.run_sync(self._up.wait, AGENT_START)
        if not up or self._error is not None or self.runtime is None:
            raise AssertionError(f"the agent app did not start: {self._error!r}")

        def clean(runtime: StreamRuntime) -> str | None:
            snapshot = runtime.book.snapshot()
            if not runtime.ready or runtime.runners or snapshot.retained or snapshot.queued or len(runtime.registry):
                return None
            if snapshot.free_slots != self.settings.max_sessions_per_worker or len(runtime.workers) != 1:
                return None
            return next(iter(runtime.workers))

        return await self.until(clean, "the agent to be ready, every slot free", AGENT_START)

    async def settle(self) -> None:
        """Wait until the agent's progress reached the authority: every session queued, waiting for its
        controller in its room, or ended (no test session here has a controller)."""

        def settled(runtime: StreamRuntime) -> bool:
            return all(r.is_terminal or r.status.value in ("queued", "joining_room") for r in runtime.registry)

        await self.until(settled, "the sessions to settle on the agent", SETTLE_DEADLINE)

    async def reset(self) -> None:
        """Leave the app as the next test expects it: live sessions deleted, slots free, records forgotten."""

        async def delete_live(runtime: StreamRuntime) -> None:
            for record in list(runtime.registry):
                if not record.is_terminal:
                    with trio.move_on_after(5):
                        await runtime.delete_session(record.session_id)

        await self.call_async(delete_live)

        def released(runtime: StreamRuntime) -> bool:
            snapshot = runtime.book.snapshot()
            return not runtime.runners and not snapshot.retained and not snapshot.queued

        await self.until(released, "every slot to be released", SETTLE_DEADLINE)
        await self.call(lambda runtime: runtime.registry.prune(
            trio.current_time(), retention_seconds=runtime.settings.terminal_retention_seconds, retention_count=0))

    def begin_stop(self) -> None:
        """Ask the app to stop, once, without waiting (:meth:`stop` waits and checks)."""
        if self._token is not None and self._stop is not None and self._thread.is_alive() and not self._stopping:
            self._stopping = True  # asked again once its loop ended, trio would raise RunFinishedError
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)

    def stop(self) -> None:
        """Stop the app (its launcher stops the agent) and check the agent process is gone."""
        self.begin_stop()
        self._thread.join(STOP_DEADLINE)
        assert not self._thread.is_alive(), "the agent app did not stop"
        if self._error is not None:
            raise AssertionError(f"the agent app failed: {self._error!r}") from self._error
        pids = self.runtime.cluster.launcher.pids if self.runtime is not None and self.runtime.cluster else []
        give_up = time.monotonic() + STOP_DEADLINE
        while alive := [pid for pid in pids if pid_alive(pid)]:
            assert time.monotonic() < give_up, f"agent processes left after the app stopped: {alive}"
            time.sleep(0.05)  # bench-cost: real-time poll of exiting agent processes, bounded by a deadline


class AgentApps:
    """A module's agent apps, one per distinct settings, the last few kept running (module-scoped)."""

    def __init__(self) -> None:
        self.apps: OrderedDict[str, AgentApp] = OrderedDict()

    async def get(self, settings: ServerSettings) -> AgentApp:
        key = repr(sorted(attrs.asdict(settings).items()))
        app = self.apps.pop(key, None)
        if app is None:
            while len(self.apps) >= KEEP_APPS:
                _, oldest = self.apps.popitem(last=False)
                await trio.to_thread.run_sync(oldest.stop)
            app = AgentApp(settings)
        self.apps[key] = app
        return app

    async def discard(self, app: AgentApp) -> None:
        """Stop ``app`` and forget it (a test failed with it in an unknown state)."""
        for key, found in list(self.apps.items()):
            if found is app:
                del self.apps[key]
        await trio.to_thread.run_sync(app.stop)

    def close(self) -> None:
        apps, self.apps = list(self.apps.values()), OrderedDict()
        for app in apps:  # the agents stop together (about a second each), then each is checked
            app.begin_stop()
        for app in apps:
            app.stop()

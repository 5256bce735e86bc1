"""Let plain ``hypercorn server:app`` (the asyncio worker) serve a trio app.

hypercorn picks its worker class before it imports the app, so the app cannot
choose trio. Under ``--worker-class trio`` this wrapper calls the app directly;
under the asyncio worker it runs the app inside one ``trio.run`` on a daemon
thread and bridges each ASGI call's receive/send between the two loops.
``hypercorn --worker-class trio server:app`` remains the faster path.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import sniffio
import trio

__all__ = ["TrioASGIAnyWorker"]

#: seconds a cancelled call waits to learn whether hypercorn's loop cancelled it or had already done it
BRIDGE_CANCEL_DEADLINE = 1.0


class TrioASGIAnyWorker:
    def __init__(self, app: Any) -> None:
        self.app = app
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._ready = threading.Event()
        self._start_lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # app.test_client(), app.test_app(), app.extensions ...
        return getattr(self.app, name)

    async def _trio_main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery, self._token = nursery, trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.sleep_forever()

    def _ensure_trio_thread(self) -> None:
        with self._start_lock:
            if self._token is None:
                threading.Thread(target=trio.run, args=(self._trio_main,), name="chunkline-trio", daemon=True).start()
                self._ready.wait()

    async def run_in_app_loop(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Await ``fn()`` in the app's trio loop, from hypercorn's loop of either worker: the same loop under the
        trio worker, this shim's trio thread under the asyncio one (the asyncio loop keeps serving meanwhile)."""
        if sniffio.current_async_library() == "trio":
            await fn()
            return
        self._ensure_trio_thread()
        token = self._token
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(trio.from_thread.run, fn, trio_token=token))

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]) -> None:
        if sniffio.current_async_library() == "trio":
            return await self.app(scope, receive, send)
        self._ensure_trio_thread()
        loop = asyncio.get_running_loop()
        token = self._token
        assert token is not None and self._nursery is not None
        done: asyncio.Future[None] = loop.create_future()
        cancel_scope = trio.CancelScope()

        def finish(exc: BaseException | None) -> None:
            if not done.done():
                if exc is None:
                    done.set_result(None)
                else:
                    done.set_exception(exc)

        def bridge(aio_fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def call(*args: Any) -> Any:
                """``aio_fn(*args)`` in hypercorn's loop, with trio's promise: cancelled, it took no effect, else
                it returns (a message hypercorn sent while the caller was being cancelled went out; told it did
                not, the caller sent it again: every client got the shutdown's ``done`` twice)."""
                event, box, tasks = trio.Event(), [], []

                def on_done(future: asyncio.Future) -> None:
                    token.run_sync_soon(lambda: (box.append(future), event.set()))

                def start() -> None:
                    tasks.append(asyncio.ensure_future(aio_fn(*args)))
                    tasks[0].add_done_callback(on_done)

                loop.call_soon_threadsafe(start)
                try:
                    await event.wait()
                except trio.Cancelled:
                    if not _ask_to_cancel(loop, tasks):  # hypercorn's loop is closed: nothing runs there any more
                        raise
                    with trio.move_on_after(BRIDGE_CANCEL_DEADLINE) as waited:
                        waited.shield = True
                        await event.wait()  # whether the call was cancelled, or had already done its work
                    if waited.cancelled_caught or box[0].cancelled():
                        raise
                return box[0].result()

            return call

        async def aio_send(message: dict) -> None:
            await send(message)
            if message["type"].startswith("lifespan.shutdown."):
                finish(None)  # hypercorn cancels the lifespan task right after this

        async def runner() -> None:
            error: BaseException | None = None
            with cancel_scope:
                try:
                    await self.app(scope, bridge(receive), bridge(aio_send))
                except Exception as exc:
                    error = exc
            try:
                loop.call_soon_threadsafe(finish, error)
            except RuntimeError:
                pass  # the asyncio loop is already closed

        token.run_sync_soon(self._nursery.start_soon, runner)
        try:
            await done
        except asyncio.CancelledError:
            token.run_sync_soon(cancel_scope.cancel)
            if scope["type"] != "lifespan" or not done.done():
                raise


def _ask_to_cancel(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Future]) -> bool:
    """Ask hypercorn's loop to cancel the call's task (queued after the call's start: the loop keeps the order);
    False when that loop is closed."""
    try:
        loop.call_soon_threadsafe(lambda: tasks[0].cancel())
    except RuntimeError:
        return False
    return True

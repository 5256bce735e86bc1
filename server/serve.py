"""Run the stream server under hypercorn's trio worker, with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import sys

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .app import SHUTDOWN_GRACE, create_app
from .settings import ServerSettings

__all__ = ["run", "serve_app"]


async def serve_app(settings: ServerSettings, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGTERM or SIGINT; live sessions drain (bounded) before the process exits."""
    app = create_app(settings)
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    config.graceful_timeout = 5.0  # sessions are drained before hypercorn is told to stop
    stop = trio.Event()  # a signal arrived
    hypercorn_stop = trio.Event()  # sessions drained: hypercorn may stop

    async def on_signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signals)
        urls = await nursery.start(
            lambda task_status: serve(app, config, shutdown_trigger=hypercorn_stop.wait, task_status=task_status)
        )
        task_status.started(urls)
        for url in urls:
            print(f"chunkline: serving {settings.pipeline} on {url} (transport: {settings.transport})", file=sys.stderr, flush=True)
        await stop.wait()
        # drain before hypercorn stops accepting: live sessions say "done" to their rooms,
        # then the local rooms send their clients away, so the sockets close promptly
        runtime = app.extensions["chunkline"]
        await runtime.shutdown(SHUTDOWN_GRACE)
        close_clients = getattr(runtime.transport, "close_clients", None)
        if close_clients is not None:
            close_clients()
        hypercorn_stop.set()
        nursery.cancel_scope.deadline = trio.current_time() + 60


def run(settings: ServerSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("livekit").setLevel(logging.ERROR)
    trio.run(serve_app, settings)
    return 0

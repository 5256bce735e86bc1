"""Run the stream server under hypercorn's trio worker, with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import sys

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .app import create_app
from .settings import ServerSettings

__all__ = ["run", "serve_app"]


async def serve_app(settings: ServerSettings, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGTERM or SIGINT; live sessions drain (bounded) before the process exits."""
    app = create_app(settings)
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    config.graceful_timeout = 30.0
    stop = trio.Event()

    async def on_signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signals)
        urls = await nursery.start(lambda task_status: serve(app, config, shutdown_trigger=stop.wait, task_status=task_status))
        task_status.started(urls)
        for url in urls:
            print(f"chunkline: serving {settings.pipeline} on {url} (transport: {settings.transport})", file=sys.stderr, flush=True)
        await stop.wait()
        nursery.cancel_scope.deadline = trio.current_time() + 60


def run(settings: ServerSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("livekit").setLevel(logging.ERROR)
    trio.run(serve_app, settings)
    return 0

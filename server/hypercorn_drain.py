"""Under ``hypercorn server:app``, the sessions drain when hypercorn is told to stop, before it closes connections.

hypercorn's worker process hears of a stop (its supervisor got SIGTERM or SIGINT) through
``check_multiprocess_shutdown_event``; from then it closes its listeners, gives connections
``--graceful-timeout`` (3 s) and cuts them, and only then runs the app's shutdown: ASGI tells an app nothing
earlier. Clients in the local rooms (WebSockets through hypercorn) were cut off without their ``done``.

:func:`install` wraps that function of hypercorn's trio and asyncio workers, in the worker process, once the app
is built: when hypercorn's stop arrives, the app drains its sessions first, as ``chunkline stream-serve`` does
before it stops hypercorn, and then hypercorn goes on. Under ``hypercorn --workers 0`` there is no such stop (a
SIGTERM ends the process at once); ``chunkline stream-serve`` drains there too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["install", "WORKER_MODULES"]

log = logging.getLogger(__name__)

#: hypercorn's worker modules whose ``check_multiprocess_shutdown_event`` becomes their workers' stop trigger
WORKER_MODULES = ("hypercorn.trio.run", "hypercorn.asyncio.run")
_DRAINS_FIRST = "chunkline_drains_first"


def install(drain: Callable[[], Awaitable[None]]) -> list[str]:
    """Make hypercorn's stop trigger await ``drain()`` (which runs from either worker's loop) once the stop has come;
    returns the modules wrapped (those of hypercorn's workers loaded in this process, each wrapped once)."""
    wrapped = []
    for name in WORKER_MODULES:
        module = sys.modules.get(name)
        original = getattr(module, "check_multiprocess_shutdown_event", None)
        if original is None or getattr(original, _DRAINS_FIRST, False):
            continue

        async def stop_trigger(shutdown_event: Any, sleep: Callable[[float], Awaitable[Any]],
                               _original: Callable[..., Awaitable[None]] = original) -> None:
            await _original(shutdown_event, sleep)  # hypercorn's supervisor was told to stop
            log.info("hypercorn is stopping: draining the sessions before it closes connections")
            await drain()

        setattr(stop_trigger, _DRAINS_FIRST, True)
        setattr(module, "check_multiprocess_shutdown_event", stop_trigger)
        wrapped.append(name)
    return wrapped

"""Under ``hypercorn server:app``, the sessions drain when hypercorn is told to stop, before it closes connections.

hypercorn's worker process hears of a stop (its supervisor got SIGTERM or SIGINT) through
``check_multiprocess_shutdown_event``; from then it closes its listeners, gives connections
``--graceful-timeout`` (3 s) and cuts them, and only then runs the app's shutdown: ASGI tells an app nothing
earlier. Clients in the local rooms (WebSockets through hypercorn) were cut off without their ``done``. A supervisor
killed with SIGKILL never sets that event: its worker takes the supervisor's end for the same stop
(:class:`SupervisorStop`) rather than serving on as an orphan with its model workers' child processes.

:func:`install` wraps that function of hypercorn's trio and asyncio workers, in the worker process, once the app
is built: when hypercorn's stop arrives, the app drains its sessions first, as ``chunkline stream-serve`` does
before it stops hypercorn, and then hypercorn goes on.

Under ``hypercorn --workers 0`` no supervisor tells the one process to stop: its trio worker had no stop at all
(SIGTERM ended the process at once, SIGINT was a KeyboardInterrupt through every task) and its asyncio worker
stopped on its own signal handlers, both without a drain. So :func:`install` also wraps their ``worker_serve``:
started without a stop trigger, it gets one that waits for SIGTERM or SIGINT, drains, and then lets hypercorn
stop as it does on its supervisor's word.

Each stop trigger passes its stop signal on to the drain: :func:`drain_then_end_a_load` ends the worker at once
after the drain when one of the app's workers still loads its pipeline, as ``chunkline stream-serve`` does (exit
128 + the signal; the load cannot be cancelled and held the worker until it returned). hypercorn's supervisor says
only that it stops, not which signal told it to: :data:`SUPERVISOR_SIGNAL` stands for it (the supervisor drops its
worker's exit status anyway, see README's Known limits).

:func:`refuse_several_workers` wraps ``worker_serve`` once more: under ``hypercorn --workers N`` with N > 1 each of the
N processes was a server of its own behind the one port (its own sessions, tokens, rooms and model workers), so a
session made through one was a 404 through the others and its token was refused by them, without a word.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["SUPERVISOR_SIGNAL", "SupervisorStop", "WORKER_MODULES", "drain_then_end_a_load", "install",
           "refuse_several_workers"]

log = logging.getLogger(__name__)

#: hypercorn's worker modules whose ``check_multiprocess_shutdown_event`` becomes their workers' stop trigger
WORKER_MODULES = ("hypercorn.trio.run", "hypercorn.asyncio.run")
_DRAINS_FIRST = "chunkline_drains_first"
_ONE_PROCESS = "chunkline_one_process"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: the stop signal a stop from hypercorn's supervisor is taken for (its shutdown event says no more than "stop")
SUPERVISOR_SIGNAL = signal.SIGTERM


def install(drain: Callable[[int], Awaitable[None]]) -> list[str]:
    """Make hypercorn's stop trigger await ``drain(signal_number)`` (which runs from either worker's loop) once the
    stop has come; returns the modules wrapped (those of hypercorn's workers loaded in this process, each wrapped
    once)."""
    wrapped = []
    for name in WORKER_MODULES:
        module = sys.modules.get(name)
        original = getattr(module, "check_multiprocess_shutdown_event", None)
        if original is None or getattr(original, _DRAINS_FIRST, False):
            continue

        async def stop_trigger(shutdown_event: Any, sleep: Callable[[float], Awaitable[Any]],
                               _original: Callable[..., Awaitable[None]] = original) -> None:
            # hypercorn's supervisor was told to stop, or is gone
            await _original(SupervisorStop(shutdown_event), sleep)
            await _draining_after(SUPERVISOR_SIGNAL, drain, "hypercorn is stopping")

        setattr(stop_trigger, _DRAINS_FIRST, True)
        setattr(module, "check_multiprocess_shutdown_event", stop_trigger)
        wrapped.append(name)
        serve = getattr(module, "worker_serve", None)
        if serve is not None and not getattr(serve, _DRAINS_FIRST, False):
            signalled = _trio_stop_signal if name == "hypercorn.trio.run" else _asyncio_stop_signal
            setattr(module, "worker_serve", _stopping_on_signals(serve, signalled, drain))
    return wrapped


class SupervisorStop:
    """hypercorn's shutdown event as its worker's stop trigger reads it (``is_set``), set also once the supervisor
    that spawned this worker is gone: killed with SIGKILL, it never set the event, and its worker served on as an
    orphan on the port, with its model workers and their child processes, until something killed it."""

    def __init__(self, event: Any) -> None:
        self.event = event
        parent = multiprocessing.parent_process()
        self.supervisor = parent.pid if parent is not None else None

    def is_set(self) -> bool:
        return bool(self.event.is_set()) or (self.supervisor is not None and os.getppid() != self.supervisor)


def refuse_several_workers(refuse: Callable[[int], None]) -> list[str]:
    """Make hypercorn's ``worker_serve`` call ``refuse(workers)`` before it serves anything when hypercorn runs more
    than one worker process (``--workers N``, N > 1): ``refuse`` ends the process. Returns the modules wrapped."""
    wrapped = []
    for name in WORKER_MODULES:
        module = sys.modules.get(name)
        serve = getattr(module, "worker_serve", None)
        if serve is None or getattr(serve, _ONE_PROCESS, False):
            continue

        @functools.wraps(serve)
        async def worker_serve(app: Any, config: Any, *args: Any, _serve: Callable[..., Awaitable[None]] = serve,
                               **kwargs: Any) -> None:
            workers = getattr(config, "workers", 1)
            if isinstance(workers, int) and workers > 1:
                refuse(workers)
            await _serve(app, config, *args, **kwargs)

        setattr(worker_serve, _ONE_PROCESS, True)
        setattr(module, "worker_serve", worker_serve)
        wrapped.append(name)
    return wrapped


def _stopping_on_signals(serve: Callable[..., Awaitable[None]], signalled: Callable[[], Awaitable[int]],
                         drain: Callable[[int], Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """hypercorn's ``worker_serve``, given a stop trigger when it has none (``--workers 0``): a stop signal, then the
    drain."""

    async def stop_trigger() -> None:
        number = await signalled()
        await _draining_after(number, drain, f"a stop signal ({signal.Signals(number).name})")

    @functools.wraps(serve)
    async def worker_serve(*args: Any, shutdown_trigger: Callable[..., Awaitable[None]] | None = None, **kwargs: Any) -> None:
        await serve(*args, shutdown_trigger=shutdown_trigger or stop_trigger, **kwargs)

    setattr(worker_serve, _DRAINS_FIRST, True)
    return worker_serve


async def _draining_after(number: int, drain: Callable[[int], Awaitable[None]], what: str) -> None:
    """Once the stop has come (by signal ``number``), the sessions drain; then hypercorn closes its connections."""
    log.info("%s: draining the sessions before hypercorn closes connections", what)
    await drain(number)


async def drain_then_end_a_load(runtime: Any, number: int) -> None:
    """In the app's loop: ``runtime``'s drain, then, if one of its workers still loads its pipeline, the worker
    process's end at once (exit 128 + ``number``) with its child processes and their /dev/shm segments, as
    ``chunkline stream-serve`` ends: nothing of the load was there to drain, and a load in a thread or a child
    cannot be cancelled (the app's shutdown waited for it to return: minutes, or for good)."""
    await runtime.drain_for_stop()

    def abandon() -> None:
        runtime.uploads.remove()
        runtime.end_service_processes_now()

    runtime.in_process.abandon_a_load(number, abandon, log)


async def _trio_stop_signal() -> int:
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        return await anext(signals)


async def _asyncio_stop_signal() -> int:
    loop = asyncio.get_running_loop()
    signalled: asyncio.Future[int] = loop.create_future()

    def on_signal(number: int) -> None:
        if not signalled.done():
            signalled.set_result(number)

    for number in STOP_SIGNALS:
        loop.add_signal_handler(number, on_signal, number)
    try:
        return await signalled
    finally:
        for number in STOP_SIGNALS:
            loop.remove_signal_handler(number)

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

hypercorn's worker process takes SIGTERM and SIGINT itself too, for as long as it serves and then on its way out
(:class:`WorkerSignals`): under its supervisor they reached it when a service manager signalled the whole process group
(systemd's default ``KillMode=control-group``, ``kill -TERM -PGID``) and ended it by the default action, with no
drain. The first one stops the worker as its supervisor's word does (and tells the supervisor, which else started a
new worker once this one had drained and exited 0); a second one, the drain under way or over, ends the process at once
with 128 + the first signal and leaves nothing behind, as under ``chunkline stream-serve`` (:mod:`server.run_signals`):
under ``--workers 0`` it met Python's default action (death by SIGTERM, or a KeyboardInterrupt traceback).

SIGHUP is hypercorn's too: its supervisor takes it for a reload (its worker drains through the shutdown event, exits
0, and a new one starts), but it reached the worker itself as well (a closed terminal sends it to its foreground process
group; ``kill -HUP -PGID``) and ended it by the default action, with no drain: the supervisor then saw a worker killed,
and stopped. Under ``--workers 0`` it ended the one process the same way. Now under the supervisor the worker takes its
own SIGHUP for the reload it is (:meth:`WorkerSignals.reloads`): it drains and exits 0 as on its supervisor's word,
which comes too after a group SIGHUP, and tells the supervisor nothing: after one to the worker alone, the supervisor
starts a new worker once this one exited 0, as its reload would. Under ``--workers 0`` there is no reload: SIGHUP is a
stop signal as SIGTERM is, and as under ``chunkline stream-serve``, unless it was ignored when the process started
(``nohup``: :func:`~server.early_signals.stop_signals`). Under the supervisor it is always taken: hypercorn's
supervisor reloads on SIGHUP under ``nohup`` too.

Each stop trigger passes its stop signal on to the drain: :func:`drain_then_end_a_load` ends the worker at once
after the drain when one of the app's workers still loads its pipeline, as ``chunkline stream-serve`` does (the load
cannot be cancelled and held the worker until it returned): with 128 + the signal after a stop signal the worker got
itself, and with 0 after hypercorn's reload or its supervisor's word. hypercorn's supervisor starts a new worker only
after a 0 and takes any other status for a reason to stop (and then drops it: README's Known limits), so a reload
while the pipeline loaded (129, or 143 on the supervisor's word) stopped the server; and its word says only that the
worker is to end, not whether it stops or reloads, nor which signal told it to. Before the worker serves, :mod:`server.early_signals` ends its start on a stop signal.

:func:`refuse_several_workers` wraps ``worker_serve`` once more: under ``hypercorn --workers N`` with N > 1 each of the
N processes was a server of its own behind the one port (its own sessions, tokens, rooms and model workers), so a
session made through one was a 404 through the others and its token was refused by them, without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import sniffio
import trio

from . import early_signals
from .early_signals import stop_signals
from .run_signals import exit_now, handlers_kept, note_stop_signal, said_to
from .stop_guard import HeldLoop

__all__ = ["SupervisorStop", "WORKER_MODULES", "WorkerSignals", "abandon", "drain_then_end_a_load", "install",
           "refuse_several_workers", "taken"]

log = logging.getLogger(__name__)

#: hypercorn's worker modules whose ``check_multiprocess_shutdown_event`` becomes their workers' stop trigger
WORKER_MODULES = ("hypercorn.trio.run", "hypercorn.asyncio.run")
_DRAINS_FIRST = "chunkline_drains_first"
_ONE_PROCESS = "chunkline_one_process"
#: the signals that stop hypercorn (its supervisor's, and its one process's under ``--workers 0``); SIGHUP is its
#: supervisor's word to start its workers again, and stops its one process under ``--workers 0`` (:func:`taken`)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install(drain: Callable[[int], Awaitable[None]], abandon: Callable[[], None], held: HeldLoop) -> list[str]:
    """Make hypercorn's stop trigger await ``drain(status)`` (which runs from either worker's loop) once the stop has
    come, ``status`` being the worker's exit status should it end at once after the drain (a load abandoned:
    :func:`drain_then_end_a_load`), and its worker process take the stop signals (:class:`WorkerSignals`; a second
    one ends the process now, ``abandon`` first; ``held`` is asked whether a pipeline holds the app's loop at the stop);
    returns the modules wrapped (those of hypercorn's workers loaded in this process, each wrapped once)."""
    signals = WorkerSignals(abandon, held)
    wrapped = []
    for name in WORKER_MODULES:
        module = sys.modules.get(name)
        original = getattr(module, "check_multiprocess_shutdown_event", None)
        if original is None or getattr(original, _DRAINS_FIRST, False):
            continue

        async def stop_trigger(shutdown_event: Any, sleep: Callable[[float], Awaitable[Any]],
                               _original: Callable[..., Awaitable[None]] = original) -> None:
            # hypercorn's supervisor was told to stop, or is gone, or this worker got a stop signal itself
            asked = SupervisorStop(shutdown_event, signals)
            held.look_when(asked.is_set, 0, abandon)  # the app's loop, if held meanwhile, is not there to read the word
            await _original(asked, sleep)
            if signals.first is None:  # a stop or a reload: the supervisor decides which once this worker exited 0
                await _draining_after(0, drain, "hypercorn is stopping or reloading")
            elif signals.reloads():
                await _draining_after(0, drain, "SIGHUP, hypercorn's reload (a new worker starts next)")
            else:
                await _draining_after(128 + signals.first, drain,
                                      f"a stop signal ({signal.Signals(signals.first).name})")
                signals.pass_on(shutdown_event)

        setattr(stop_trigger, _DRAINS_FIRST, True)
        setattr(module, "check_multiprocess_shutdown_event", stop_trigger)
        wrapped.append(name)
        serve = getattr(module, "worker_serve", None)
        if serve is not None and not getattr(serve, _DRAINS_FIRST, False):
            setattr(module, "worker_serve", _taking_stop_signals(serve, signals, drain))
    return wrapped


def taken(supervised: bool) -> tuple[int, ...]:
    """The signals hypercorn's worker process takes: SIGTERM and SIGINT, and SIGHUP under its supervisor (a reload)
    or, under ``--workers 0``, unless it was ignored as the process started (``nohup``)."""
    if supervised:
        return (*STOP_SIGNALS, signal.SIGHUP)
    return STOP_SIGNALS + tuple(number for number in stop_signals() if number == signal.SIGHUP)


class WorkerSignals:
    """The stop signals (SIGTERM, SIGINT, SIGHUP: :func:`taken`) of hypercorn's worker process, taken as it begins to
    serve (:meth:`take`) and kept on its way out once one came (:meth:`release`).

    The first one is :attr:`first`: it stops the worker as its supervisor's word does (:class:`SupervisorStop`), and is
    passed on to the supervisor once the sessions drained (:meth:`pass_on`), unless it is SIGHUP under the supervisor,
    which is the supervisor's reload (:meth:`reloads`). Any later one ends the process at once with 128 + the first
    (:func:`~server.run_signals.exit_now`, ``abandon`` first): the drain is taking too long, or the process is on its
    way out, where the signal's default action ended it, leaving its service children's shared memory behind.

    Under trio they are plain handlers (trio wakes on any signal; they run even while the loop is busy); under asyncio
    the loop's own (a plain handler might wait for the loop's next wake-up), and plain ones once the worker is done
    (the loop put the default actions back as it closed). The first has the app's trio loop looked at (``held``): one
    that a pipeline holds (code that never awaits) ends the process after 2 s, naming that code
    (:mod:`server.stop_guard`), where the drain waited for the loop for as long as the code ran."""

    def __init__(self, abandon: Callable[[], None], held: HeldLoop) -> None:
        self.abandon = abandon
        self.held = held

        self.first: int | None = None
        self.supervised = False
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: Callable[[], None] | None = None

    def take(self, supervised: bool) -> Callable[[], Awaitable[int]]:
        """In the main thread, in hypercorn's loop: take the stop signals (``supervised``: under hypercorn's
        supervisor, not ``--workers 0``); returns what waits for the first."""
        self.supervised = supervised
        # the handlers the app's start put in (early_signals) give way, and what they noted is taken as it came now
        started = early_signals.replaced()
        self._previous = {number: started.get(number, signal.getsignal(number)) for number in taken(supervised)}
        woken: trio.Event | asyncio.Event
        if sniffio.current_async_library() == "trio":
            token, woken = trio.lowlevel.current_trio_token(), trio.Event()
            self._wake = functools.partial(token.run_sync_soon, woken.set, idempotent=True)  # safe in a signal handler
            for number in self._previous:
                signal.signal(number, self._plain)
        else:
            loop, woken = asyncio.get_running_loop(), asyncio.Event()
            self._loop, self._wake = loop, woken.set  # its handlers run in the loop
            for number in self._previous:
                loop.add_signal_handler(number, self.signalled, number)
        for number in early_signals.let_go():
            if number in self._previous:
                self.signalled(number)

        async def first() -> int:
            if self.first is None:
                await woken.wait()
            assert self.first is not None
            return self.first

        return first

    def kept(self) -> contextlib.AbstractContextManager[None]:
        """While the worker serves: under trio, where the app runs in this (the main) thread, the handlers taken are
        put back when a pipeline replaced them (``signal.signal`` in its ``running()``: a stop signal reached only its
        handler, and the worker served on), said once each. Under asyncio the app runs in a thread of its own, where
        no handler can be set."""
        if self._loop is not None:
            return contextlib.nullcontext()
        return handlers_kept({number: signal.getsignal(number) for number in self._previous}, said_to(log))

    def release(self) -> None:
        """As the worker ends, in its loop: with no stop signal, the handlers it had; after one, plain handlers that
        end the process at once on another."""
        self._wake = None
        if self._loop is not None:
            for number in self._previous:
                self._loop.remove_signal_handler(number)  # else the loop puts the default actions back as it closes
            self._loop = None
        for number, previous in self._previous.items():
            if self.first is not None:
                signal.signal(number, self._plain)
            else:  # (None: a handler set outside Python, taken for the default)
                signal.signal(number, signal.SIG_DFL if previous is None else previous)

    def _plain(self, number: int, _frame: Any) -> None:
        self.signalled(number)

    def signalled(self, number: int) -> None:
        if self.first is not None:
            exit_now(128 + self.first, f"a second stop signal ({signal.Signals(number).name}) as hypercorn stops",
                     self.abandon, log)
        self.first = number
        note_stop_signal()  # the interpreter's very last teardown ignores them (run_signals._teardown)
        self.held.look(128 + number, self.abandon)
        if self._wake is not None:
            self._wake()

    def reloads(self) -> bool:
        """Whether the first signal is SIGHUP under hypercorn's supervisor: its reload, whose word (the shutdown event)
        comes too after a SIGHUP to the process group; after one to this worker alone, the supervisor starts a new
        worker once this one exited 0, as its reload does."""
        return self.supervised and self.first == signal.SIGHUP

    def pass_on(self, shutdown_event: Any) -> None:
        """Once the sessions drained after this worker's own first signal: the same signal to hypercorn's supervisor,
        unless it was told to stop already (the signal came to the whole process group), so that it stops too rather
        than start a new worker once this one exits 0. Not as the signal comes: two at once could each run the
        supervisor's handler, the second inside the first, waiting for the lock the first holds (its shutdown
        event's), for good."""
        supervisor = multiprocessing.parent_process()
        if (self.first is not None and not self.reloads() and supervisor is not None and supervisor.pid == os.getppid()
                and not shutdown_event.is_set()):
            os.kill(supervisor.pid, self.first)


class SupervisorStop:
    """hypercorn's shutdown event as its worker's stop trigger reads it (``is_set``), set also once the supervisor
    that spawned this worker is gone, or once the worker got a stop signal itself (``signals``). Killed with SIGKILL,
    the supervisor never set the event, and its worker served on as an orphan on the port, with its model workers and
    their child processes, until something killed it."""

    def __init__(self, event: Any, signals: WorkerSignals | None = None) -> None:
        self.event = event
        self.signals = signals
        parent = multiprocessing.parent_process()
        self.supervisor = parent.pid if parent is not None else None

    def is_set(self) -> bool:
        return (bool(self.event.is_set()) or (self.supervisor is not None and os.getppid() != self.supervisor)
                or (self.signals is not None and self.signals.first is not None))


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


def _taking_stop_signals(serve: Callable[..., Awaitable[None]], signals: WorkerSignals,
                         drain: Callable[[int], Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """hypercorn's ``worker_serve`` with the process's stop signals taken while it serves (:class:`WorkerSignals`),
    and given a stop trigger when it has none (``--workers 0``): the first stop signal, then the drain."""

    @functools.wraps(serve)
    async def worker_serve(*args: Any, shutdown_trigger: Callable[..., Awaitable[None]] | None = None,
                           **kwargs: Any) -> None:
        early_signals.hypercorn_worker_serves()  # one since the app was built ends the start here, nothing begun
        first = signals.take(supervised=shutdown_trigger is not None)

        async def stop_trigger() -> None:
            number = await first()
            await _draining_after(128 + number, drain, f"a stop signal ({signal.Signals(number).name})")

        try:
            with signals.kept():
                await serve(*args, shutdown_trigger=shutdown_trigger or stop_trigger, **kwargs)
        finally:
            signals.release()

    setattr(worker_serve, _DRAINS_FIRST, True)
    return worker_serve


async def _draining_after(status: int, drain: Callable[[int], Awaitable[None]], what: str) -> None:
    """Once the stop has come (``what``), the sessions drain; then hypercorn closes its connections (or the worker
    ends at once with ``status``, its load abandoned)."""
    log.info("%s: draining the sessions before hypercorn closes connections", what)
    await drain(status)


def abandon(runtime: Any) -> None:
    """Before the worker process ends at once: what ``runtime`` holds on disk, and its service processes with what
    their channels hold in /dev/shm (their parent-death signal would end them and leave that behind)."""
    runtime.uploads.remove()
    runtime.end_service_processes_now()


async def drain_then_end_a_load(runtime: Any, status: int) -> None:
    """In the app's loop: ``runtime``'s drain, then, if one of its workers still loads its pipeline, the worker
    process's end at once, exit ``status``, with its child processes and their /dev/shm segments, as ``chunkline
    stream-serve`` ends: nothing of the load was there to drain, and a load in a thread or a child cannot be
    cancelled (the app's shutdown waited for it to return: minutes, or for good).

    ``status`` is 128 + the signal for a stop signal the worker got itself, and 0 for hypercorn's reload or its
    supervisor's word (which does not say whether it stops or reloads): its supervisor starts a new worker only
    after a 0, and takes any other status for a reason to stop (a reload during a load stopped the server)."""
    await runtime.drain_for_stop()
    if runtime.in_process.loading():
        why = "a worker still loads its pipeline (nothing of it to drain)"
        if status == 0:
            why += "; hypercorn's supervisor starts a new worker if it reloads"
        exit_now(status, why, functools.partial(abandon, runtime), log)

"""How ``chunkline run`` answers SIGINT, SIGTERM, SIGHUP and SIGQUIT: the first starts an orderly stop, a second
aborts.

The orderly stop cancels the run, so the pipeline closes its session and its stages as it would on any
error, and its temporary files go; that can take as long as the pipeline's own close deadline when a stage
hangs (an orchestrator waits up to its ``close_timeout`` for a stage's call). SIGHUP (the terminal was closed) is
a stop signal too: its default action ended the run at once, leaving its temporary file and the stages' shared
memory behind (ignored when the process started, as under ``nohup``, it stays ignored); so is SIGQUIT (Ctrl-\\),
whose default action did the same with a core dump (:data:`server.early_signals.RUN_STOP_SIGNALS`: the command
takes it from its first line). A second signal during
that stop does not wait for anything: the caller's ``abort`` removes what the run left and
ends the process at once. The handlers are plain Python signal handlers, so the abort runs even while the
trio loop is busy; the first signal only asks the loop to cancel (``TrioToken.run_sync_soon`` is safe to
call from a signal handler). A run the first signal stopped keeps the handlers: the caller is about to exit
with that signal's code, and a second signal on the way (after the stop finished) aborts as during the stop,
rather than ending the process by the signal itself.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn

import trio

from engine.supervised_child import end_descendants_now
from engine.tensor_channel_refs import unlink_every_owned_segment

from . import early_signals
from .early_signals import STOP_SIGNALS, stop_signals

__all__ = ["StoppedBySignal", "exit_now", "exit_on_stop_signals", "handlers_kept", "note_stop_signal",
           "run_until_signalled", "stop_signal_came", "trio_run_until_signalled"]

_stopped_by_signal = False


def note_stop_signal() -> None:
    """A stop signal ends this process: its last teardown ignores the stop signals (see :func:`_teardown`)."""
    global _stopped_by_signal
    _stopped_by_signal = True


def stop_signal_came() -> bool:
    """Whether a stop signal reached this module's handlers: a KeyboardInterrupt without one is the pipeline's own
    (it raised it), not the user's Ctrl-C."""
    return _stopped_by_signal


@atexit.register  # at import, so it runs after the exit calls registered later (atexit runs them last first)
def _teardown() -> None:
    """Once the exit calls ran, Python puts the default action back on every signal it had a handler of its own
    for, then tears the interpreter down: a second signal in that last moment ended a process a signal had
    stopped by the signal itself (killed by SIGTERM, not exit 130, and nothing said). Ignored there instead, the
    process ends with the first signal's status."""
    if _stopped_by_signal:
        for number in {*STOP_SIGNALS, *stop_signals()}:  # SIGQUIT too, where the command stops on it
            signal.signal(number, signal.SIG_IGN)


def exit_now(code: int, why: str, remove: Callable[[], None], log: logging.Logger) -> NoReturn:
    """End the process without waiting for anything (a second stop signal, a watchdog), leaving nothing behind.

    ``os._exit`` skips every ``finally`` and finalizer, and nothing is logged after its one line: its child processes
    go first, with the shared memory they made (:func:`~engine.supervised_child.end_descendants_now`: their
    parent-death signal alone left that in /dev/shm, and their own children running), then ``remove`` takes what the
    process holds on disk, then the shared memory of the channels it made itself goes."""
    log.error("%s: exiting now (exit %d)", why, code)
    # nothing more is said: a thread of its own (the trio loop of hypercorn's asyncio worker, the loop a watchdog
    # thread ends) logged the failures of the children killed next as errors, with their tracebacks
    logging.disable(logging.CRITICAL)
    logging.shutdown()
    end_descendants_now()
    remove()
    unlink_every_owned_segment()
    os._exit(code)


def exit_on_stop_signals(code: int, why: str, remove: Callable[[], None], log: logging.Logger) -> None:
    """From now until the process ends, a stop signal ends it at once with ``code`` (:func:`exit_now`).

    For a process whose trio run took the signals and is over, or ending: trio put back the handlers it found
    (Python's defaults), and a signal on the way out ended the process by its default action (-15, or a
    KeyboardInterrupt traceback), skipping every cleanup. Plain handlers run even while the loop is busy."""

    def handler(number: int, _frame: Any) -> None:
        exit_now(code, f"a stop signal ({signal.Signals(number).name}) {why}", remove, log)

    note_stop_signal()  # the interpreter's very last teardown ignores them instead (see _teardown)
    for number in stop_signals():
        signal.signal(number, handler)


class StoppedBySignal(Exception):
    """The first stop signal cancelled the run; ``signal_number`` says which one, ``met`` what the stop met (a close
    cut at its deadline)."""

    def __init__(self, signal_number: int, met: tuple[str, ...] = ()) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number
        self.met = met


#: how often a run looks whether the pipeline replaced its stop signals' handlers
HANDLER_LOOK = 0.5


async def run_until_signalled(
    run: Callable[..., Awaitable[Any]],
    *args: Any,
    on_stop: Callable[[int], None],
    abort: Callable[[int], NoReturn],
    on_taken: Callable[[int], None] = lambda number: None,
) -> Any:
    """``await run(*args)`` with the stop signals handled as the module says.

    ``on_stop(first)`` runs in the signal handler when the first signal arrives, to tell the user at once (no
    buffered I/O: it may interrupt a write): run in the trio loop, it waited for a pipeline that blocks the loop (a
    blocking call in an ``async def``), and the user was told nothing, nor that a second signal aborts.
    ``abort(first)`` runs in the signal handler on a second one and must not return. Raises
    :class:`StoppedBySignal` when the first signal cancelled the run (even if the run then failed while stopping:
    the user asked it to stop). A handler the pipeline puts in place of one of these (``signal.signal`` in its
    ``running()``) is replaced by the run's again within :data:`HANDLER_LOOK`, and ``on_taken(number)`` says so once
    a signal: the run was deaf to Ctrl-C, without a word.
    """
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()
    first: list[int] = []

    def stop_now(number: int) -> None:
        scope.cancel(reason=f"{signal.Signals(number).name} received")

    def handler(number: int, _frame: Any) -> None:
        if early_signals.forked_away(number):  # a pipeline's forked child: not the run
            return
        if first:
            abort(first[0])
        first.append(number)
        note_stop_signal()
        on_stop(number)
        token.run_sync_soon(stop_now, number)

    previous = {number: signal.signal(number, handler) for number in stop_signals()}
    early_signals.replay()  # one that came as the run started (the command deferred it): the stop begins now
    try:
        with handlers_kept(dict.fromkeys(previous, handler), on_taken), scope:
            try:
                return await run(*args)
            except Exception as exc:
                if first:
                    raise StoppedBySignal(first[0]) from exc
                raise
        raise StoppedBySignal(first[0])  # reached only when the first signal's cancel ended the run
    finally:
        if not first:  # once stopped by a signal, the process exits with its code: a later signal aborts
            for number, old in previous.items():  # (else it could kill the process on its way out by itself)
                signal.signal(number, old)


@contextlib.contextmanager
def handlers_kept(handlers: dict[int, Any], on_taken: Callable[[int], None]) -> Iterator[None]:
    """While in it (in trio): every :data:`HANDLER_LOOK`, put back each of ``handlers`` (signal -> handler) that a
    pipeline replaced with one of its own (``signal.signal`` in its ``running()``), saying so once each with
    ``on_taken(number)``."""
    scope = trio.CancelScope()
    trio.lowlevel.spawn_system_task(_keep_handlers, scope, handlers, on_taken)
    try:
        yield
    finally:
        scope.cancel()


def said_to(log: logging.Logger) -> Callable[[int], None]:
    """A server's ``on_taken`` for :func:`handlers_kept`: a warning on ``log`` naming the signal."""

    def taken(number: int) -> None:
        log.warning("pipeline bug: the pipeline replaced the server's %s handler; the server put its own back (a stop "
                    "signal drains the sessions)", signal.Signals(number).name)

    return taken


async def _keep_handlers(scope: trio.CancelScope, handlers: dict[int, Any], on_taken: Callable[[int], None]) -> None:
    told: set[int] = set()
    with scope:
        while True:
            await trio.sleep(HANDLER_LOOK)
            for number, handler in handlers.items():
                if signal.getsignal(number) is not handler:
                    signal.signal(number, handler)
                    if number not in told:
                        told.add(number)
                        on_taken(number)


def _interrupt(number: int, frame: Any) -> None:
    if early_signals.forked_away(number):
        return
    note_stop_signal()
    raise KeyboardInterrupt


def trio_run_until_signalled(run: Callable[..., Awaitable[Any]], *args: Any, on_stop: Callable[[int], None],
                             abort: Callable[[int], NoReturn],
                             on_taken: Callable[[int], None] = lambda number: None) -> Any:
    """:func:`run_until_signalled` in a trio run of its own, whose end leaves SIGINT's handler to it.

    trio takes SIGINT for its run when Python's default handler is in place, and puts that default back as the
    run ends: a Ctrl-C after a SIGTERM's stop had finished then ended the process as a KeyboardInterrupt (130),
    not as the abort with the first signal's code (143). With a handler of ours in place first, trio leaves
    SIGINT alone.
    """
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)  # as the default does, until the run puts its own in
    return trio.run(functools.partial(run_until_signalled, run, *args, on_stop=on_stop, abort=abort,
                                      on_taken=on_taken))

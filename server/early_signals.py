"""Stop signals from the ``chunkline`` command's first line, before a command handles them itself.

Until a command put its own handlers in (``chunkline run``'s orderly stop, stream-serve's drain), Python's defaults
applied: a Ctrl-C during the imports printed a KeyboardInterrupt traceback (exit -2), and SIGTERM or SIGHUP (a
closed terminal) ended the process by the signal itself (-15, -1), nothing said. :func:`install` puts a handler on
each stop signal that raises :class:`StopSignalled` instead; the entry point catches it, says so in one line and
exits ``128 + signal``. The first one sets the stop signals to be ignored, so a second cannot break off the way
out. A command that takes the signals over in a trio run of its own calls :func:`defer` first: a signal then is
noted, and :func:`replay` sends the noted ones again once the run's own receiver is open. The receiver puts the
noting handler back as it closes (``chunkline worker``): a signal after the run, its exit status decided and the
process on its way out, is noted and changes nothing (Python's default action ended the process by itself).

SIGHUP ignored when the process started (``nohup chunkline ...``) stays ignored, here and in the commands
(:func:`stop_signals`). ``chunkline run`` stops on SIGQUIT (Ctrl-\\) as well, from its first line
(:data:`RUN_STOP_SIGNALS`, :func:`stop_also`): its default action ended the run at once with a core dump, leaving
its temporary files and its stages' shared memory behind.

hypercorn's worker process (``hypercorn server:app``) runs none of the ``chunkline`` command: there the package's
first line calls :func:`starting_hypercorn_worker`. While hypercorn's worker imports and builds the app (a second
or more), a stop signal met Python's default action: killed by SIGTERM or SIGHUP, a KeyboardInterrupt traceback
under ``--workers 0``; under hypercorn's supervisor a SIGHUP, its reload (a closed terminal, ``kill -HUP -PGID``),
killed the worker and the supervisor then stopped instead of starting a new one. Now such a signal unwinds the start
with ``SystemExit`` (no traceback, one line): exit 0 for SIGHUP under the supervisor, so that the supervisor starts
a new worker (its reload), else 128 + the signal (a supervised worker's nonzero status stops the supervisor too).
Once the app is built (:func:`hypercorn_app_built`) a stop signal is noted instead, not raised into hypercorn's code
or its event loop's start, and ends the start the same way as the worker's loop begins to serve
(:func:`hypercorn_worker_serves`); there the worker's own handlers take the signals over with the handlers these
replaced (:func:`replaced`, :func:`let_go`, ``server.hypercorn_drain.WorkerSignals``). What is left: from the
worker's exec until the package's first line (Python's start, hypercorn's imports: 0.1 to 0.2 s) no chunkline code
runs, and a signal meets the default action there.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any, NoReturn

__all__ = ["RUN_STOP_SIGNALS", "STOP_SIGNALS", "StopSignalled", "defer", "describe", "hand_over", "hypercorn_app_built",
           "hypercorn_worker_serves", "install", "let_go", "replaced", "replay", "starting_hypercorn_worker",
           "stop_also", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: what ``chunkline run`` stops on besides :data:`STOP_SIGNALS`: SIGQUIT (Ctrl-\), whose default action dumped core
#: and left the run's temporary files and shared memory; the server's commands keep its default
RUN_STOP_SIGNALS = (signal.SIGQUIT,)
#: hypercorn's worker functions' modules: they call ``load_application`` in its worker process
HYPERCORN_WORKERS = ("hypercorn.trio.run", "hypercorn.asyncio.run")

_previous: dict[int, Any] = {}
#: the command's stop signals besides :data:`STOP_SIGNALS` (:func:`stop_also`)
_also: list[int] = []
_noted: list[int] = []
#: while hypercorn's worker starts (:func:`starting_hypercorn_worker`): each stop signal's exit status
_start_statuses: dict[int, int] = {}


class StopSignalled(BaseException):
    """A stop signal arrived before the command handled them itself (a BaseException: a pipeline's
    ``except Exception`` does not swallow it)."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a command: SIGINT, SIGTERM, and SIGHUP unless it is ignored (``nohup``), and those it
    stops on as well (:func:`stop_also`: SIGQUIT for ``chunkline run``)."""
    return tuple(number for number in (*STOP_SIGNALS, *_also)
                 if number != signal.SIGHUP or signal.getsignal(number) is not signal.SIG_IGN)


def stop_also(*numbers: int) -> None:
    """This command stops on ``numbers`` too (``chunkline run``: :data:`RUN_STOP_SIGNALS`), from :func:`install` on
    and in every handler of the stop signals (:func:`stop_signals`), until :func:`hand_over`."""
    _also.extend(number for number in numbers if number not in (*STOP_SIGNALS, *_also))


def describe(number: int) -> str:
    """How a command says it was stopped: ``interrupted``, ``terminated (SIGTERM)``, ``hung up (SIGHUP)``,
    ``quit (SIGQUIT)``."""
    return {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)",
            signal.SIGQUIT: "quit (SIGQUIT)"}.get(number, "interrupted")


_HOME = os.getpid()  # the command's process: a fork of it (a pipeline's multiprocessing child) copies the handlers


def forked_away(number: int) -> bool:
    """Whether this is a fork of the command's process (a pipeline's ``multiprocessing`` child, chunkline's handlers
    copied into it): there the signal gets its default action, as it would without chunkline, and the handler does
    nothing more. Such a child, ended with SIGTERM at a run's end, printed a ``StopSignalled`` traceback, or said
    ``SIGTERM received, stopping the run`` after the run had succeeded."""
    if os.getpid() == _HOME:
        return False
    signal.signal(number, signal.SIG_DFL)
    signal.raise_signal(number)
    return True


def _raise(number: int, _frame: Any) -> None:
    if forked_away(number):
        return
    _ignore_ours()  # the process is on its way out: nothing may break that off
    raise StopSignalled(number)


def _note(number: int, _frame: Any) -> None:
    if not forked_away(number):
        _noted.append(number)


def _end_start(number: int, frame: FrameType | None) -> None:
    """hypercorn's worker is starting: end it (``SystemExit``), saying so in one line."""
    if forked_away(number):
        return
    if _loading_frame(frame) is None:  # past hypercorn's load of an app that is not ``server:app`` (never built)
        hand_over()  # the handlers there were before, as if this module had never been here
        signal.raise_signal(number)
        return
    _noted.append(number)  # should the SystemExit be swallowed (raised in a finalizer), the start's end sees it
    _end_the_start(number)


def _end_the_start(number: int) -> NoReturn:
    _ignore_ours()  # the process is on its way out: nothing may break that off
    status = _start_statuses[number]
    then = "hypercorn's reload starts a new worker" if status == 0 else f"exit {status}"
    try:  # not print(): the signal may have come in the middle of a write to sys.stderr
        os.write(2, f"chunkline: {describe(number)} as hypercorn's worker started: {then}\n".encode())
    except OSError:  # a closed terminal: the exit status says it
        pass
    raise SystemExit(status)


_OURS = (_raise, _note, _end_start)


def _ignore_ours() -> None:
    for each in (*STOP_SIGNALS, *_also):
        if signal.getsignal(each) in _OURS:
            signal.signal(each, signal.SIG_IGN)


def _put(handler: Any) -> None:
    for number in stop_signals():
        current = signal.getsignal(number)
        if current in _OURS:
            signal.signal(number, handler)
        elif number not in _previous:
            _previous[number] = current
            signal.signal(number, handler)


def install() -> None:
    """Raise :class:`StopSignalled` on a stop signal (in the main thread only; elsewhere nothing changes)."""
    try:
        _put(_raise)
    except ValueError:  # not the main thread (a test calling the entry point): signals are not its to take
        pass


def defer() -> None:
    """Note a stop signal instead of raising it: the command's trio run takes them over and :func:`replay`-s them."""
    if signal.getsignal(signal.SIGINT) in _OURS:
        _put(_note)


def replay() -> None:
    """Send the stop signals noted since :func:`defer` again (to the handlers now in place)."""
    while _noted:
        signal.raise_signal(_noted.pop(0))


def hand_over() -> None:
    """Put back the handlers :func:`install` replaced, where they are still this module's, and forget the signals of
    :func:`stop_also`."""
    for number, previous in list(_previous.items()):
        if signal.getsignal(number) in _OURS:
            signal.signal(number, previous)
        del _previous[number]
    _also.clear()


def _loading_frame(frame: FrameType | None) -> FrameType | None:
    """hypercorn's ``load_application``'s frame where its worker (not its supervisor's reloader) called it and it is
    on the stack from ``frame`` up; else None."""
    while frame is not None:
        if frame.f_code.co_name == "load_application" and frame.f_globals.get("__name__") == "hypercorn.utils":
            caller = frame.f_back
            return frame if caller is not None and caller.f_globals.get("__name__") in HYPERCORN_WORKERS else None
        frame = frame.f_back
    return None


def starting_hypercorn_worker() -> None:
    """Where hypercorn's worker process loads its app now (this is called from within that): a stop signal ends
    it at once, in one line, until :func:`hypercorn_app_built`; SIGHUP under hypercorn's supervisor (its reload)
    with exit 0, so that the supervisor starts a new worker, any other with 128 + the signal. Elsewhere (``import
    server`` in any other process) nothing changes."""
    loading = _loading_frame(sys._getframe(1))
    if loading is None or _start_statuses:
        return
    supervised = loading.f_back is not None and loading.f_back.f_locals.get("shutdown_event") is not None
    _start_statuses.update({number: 128 + number for number in STOP_SIGNALS})
    if supervised:
        _start_statuses[signal.SIGHUP] = 0
    try:
        _put(_end_start)
    except ValueError:  # not the main thread: not its signals to take
        _start_statuses.clear()


def hypercorn_app_built() -> None:
    """hypercorn's worker built the app (``server:app``): from now until it begins to serve a stop signal is noted
    (:func:`hypercorn_worker_serves`), not raised into hypercorn's code or its event loop's start. A stop signal
    whose ``SystemExit`` was swallowed (raised in a finalizer) ends the start now."""
    if not _start_statuses:
        return
    if _noted:
        raise SystemExit(_start_statuses[_noted[0]])  # its line was said
    _put(_note)


def hypercorn_worker_serves() -> None:
    """hypercorn's worker, in its event loop, is about to take the stop signals and serve: one noted since the app
    was built ends the start now, as one before it would have (``SystemExit``, nothing started: the pipeline's load
    and the app's startup would only have been undone)."""
    if _start_statuses and _noted:
        _end_the_start(_noted[0])


def replaced() -> dict[int, Any]:
    """The handlers this module's replaced, where its own are in place (for handlers about to replace them: hypercorn's
    worker as it begins to serve, ``server.hypercorn_drain.WorkerSignals``, which puts them back as it ends)."""
    return {number: handler for number, handler in _previous.items() if signal.getsignal(number) in _OURS}


def let_go() -> list[int]:
    """Once other handlers replaced this module's (:func:`replaced`): the signals noted until then, in order, for them
    to take as their own; this module forgets them and what its handlers replaced."""
    noted = list(_noted)
    _previous.clear()
    _noted.clear()
    _start_statuses.clear()
    return noted

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
(:func:`stop_signals`).
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignalled", "defer", "describe", "hand_over", "install", "replay", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_previous: dict[int, Any] = {}
_noted: list[int] = []


class StopSignalled(BaseException):
    """A stop signal arrived before the command handled them itself (a BaseException: a pipeline's
    ``except Exception`` does not swallow it)."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a command: SIGINT, SIGTERM, and SIGHUP unless it is ignored (``nohup``)."""
    return tuple(number for number in STOP_SIGNALS
                 if number != signal.SIGHUP or signal.getsignal(number) is not signal.SIG_IGN)


def describe(number: int) -> str:
    """How a command says it was stopped: ``interrupted``, ``terminated (SIGTERM)``, ``hung up (SIGHUP)``."""
    return {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}.get(number, "interrupted")


def _raise(number: int, _frame: Any) -> None:
    for each in STOP_SIGNALS:
        if signal.getsignal(each) in (_raise, _note):
            signal.signal(each, signal.SIG_IGN)  # the process is on its way out: nothing may break that off
    raise StopSignalled(number)


def _note(number: int, _frame: Any) -> None:
    _noted.append(number)


def _put(handler: Any) -> None:
    for number in stop_signals():
        current = signal.getsignal(number)
        if current in (_raise, _note):
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
    if signal.getsignal(signal.SIGINT) in (_raise, _note):
        _put(_note)


def replay() -> None:
    """Send the stop signals noted since :func:`defer` again (to the handlers now in place)."""
    while _noted:
        signal.raise_signal(_noted.pop(0))


def hand_over() -> None:
    """Put back the handlers :func:`install` replaced, where they are still this module's."""
    for number, previous in list(_previous.items()):
        if signal.getsignal(number) in (_raise, _note):
            signal.signal(number, previous)
        del _previous[number]

"""A stop signal's promises that trio's loop cannot keep: a pipeline that holds the server's loop.

The drain, its bound and a second signal's abort all ran in the trio loop. A pipeline call that never awaits (a
``time.sleep`` in ``push_control``, a synchronous model load in ``running()``, a blocking ``check_options``) holds the
loop, and with it the server: a stop signal then started nothing, the 55 s bound counted from whenever the loop came
back (135 s after the signal in one case), and a second signal did nothing either. Python runs a signal's handler on
the main thread between the pipeline's bytecodes (a ``time.sleep`` included), so the handlers here do what needs no
loop: the first signal arms the bound (:class:`BoundWatch`, a thread started with the server) and has the loop looked
at (:class:`~pipelines.loop_watch.LoopWatchdog`); a loop that does not answer within its grace (2 s) ends the process
naming the code that holds it; a second signal ends it at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from pipelines.loop_watch import LoopWatchdog

from .run_signals import exit_now, note_stop_signal

__all__ = ["CANNOT_DRAIN", "BoundWatch", "HeldLoop", "StopGuard"]

#: what a held loop keeps a stop signal from doing, as the line that ends the process says it
CANNOT_DRAIN = "the server could not drain its sessions in order"


class BoundWatch:
    """The last resort: a thread that ends the process if the shutdown passes its bound once :meth:`arm` ed (then
    :meth:`cancel` it). Its thread starts with it, before any signal: a signal's handler only arms it, since starting
    a thread there could wait for good on a lock of the threading module that the interrupted code held.

    Its exit status is 128 + the stop signal that began the shutdown, as a second signal's abort, not 1: the process
    was asked to stop and it stopped, within its bound, taking what it holds with it; only its drain was cut short.
    A supervisor reads a stop the same way from an agent (``states.agent.exit_status``: 0 once a drain ran its
    course, else 128 + the first stop signal) and from ``chunkline run``; 1 ("failed") would have it count a
    requested stop as a crash (55 s is also past Kubernetes' default 30 s grace: SIGKILL, 137, comes first there).
    1 is left for a shutdown no signal began (``serve_app``'s ``stop``), where nothing else says why it ended."""

    def __init__(self, bound: float, remove: Callable[[], None], signalled: list[int],
                 log: logging.Logger = logging.getLogger("chunkline.serve")) -> None:
        self._bound = bound
        self._armed_at: float | None = None  # time.monotonic() of the first arming
        self._armed = threading.Event()
        self._cancelled = threading.Event()

        def watch() -> None:
            self._armed.wait()
            if not self._cancelled.wait(bound):
                exit_now(128 + signalled[0] if signalled else 1, f"shutdown exceeded its bound of {bound:g} s", remove,
                         log)

        self._thread = threading.Thread(target=watch, name="chunkline-shutdown-bound", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """The bound counts from now (again: it counts from the first arming)."""
        if self._armed_at is None:
            self._armed_at = time.monotonic()
        self._armed.set()

    def seconds_left(self) -> float:
        """Of the bound, counted from the first arming (the whole bound before it)."""
        return self._bound if self._armed_at is None else self._bound - (time.monotonic() - self._armed_at)

    def cancel(self) -> None:
        """The shutdown ended in its bound; the thread is gone when this returns (it ends at once)."""
        self._cancelled.set()
        self._armed.set()
        self._thread.join()


class HeldLoop:
    """Looks, at a stop, whether a pipeline holds the app's trio loop, and if so ends the process saying where.

    The runtime makes it and runs it in the app's loop, whatever hosts that loop (``chunkline stream-serve``, hypercorn's
    trio worker, the asyncio worker's trio thread); whoever hears the stop asks it, from any thread (:meth:`look`), or
    has it read a stop that comes without a signal (:meth:`look_when`). Meanwhile it looks at the loop once a second:
    one held for 5 s is logged, naming the code that holds it, and again once it is free."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._exit: tuple[int, Callable[[], None]] = (0, lambda: None)  # the status and what to take first
        self._watchdog = LoopWatchdog(self._held, cannot=CANNOT_DRAIN, on_held=log.warning)

    def start(self) -> None:
        """In the app's trio loop (:meth:`stop` as the loop's work ends)."""
        self._watchdog.start()

    def stop(self) -> None:
        self._watchdog.stop()

    def look(self, status: int, abandon: Callable[[], None]) -> None:
        """A stop came: look at the loop now; held past the grace, the process ends with ``status``, ``abandon`` first
        (128 + the stop signal; 0 for hypercorn's supervisor's word, which a reload follows)."""
        self._exit = (status, abandon)
        self._watchdog.probe()

    def look_when(self, stop_asked: Callable[[], bool], status: int, abandon: Callable[[], None]) -> None:
        """Look at the loop once ``stop_asked()``, read off the loop about once a second, is true."""
        self._exit = (status, abandon)
        self._watchdog.probe_when(stop_asked)

    def _held(self, line: str) -> None:
        status, abandon = self._exit
        exit_now(status, line, abandon, self._log)


class StopGuard:
    """Hears each stop signal before trio does (:meth:`wrap`): the first arms the shutdown's bound and looks at the
    loop; a second ends the process at once, saying what it cut short (``cut_short()``, e.g. ``the drain``)."""

    def __init__(self, bound: float, abandon: Callable[[], None], cut_short: Callable[[], str], held: HeldLoop,
                 log: logging.Logger) -> None:
        self.signalled: list[int] = []  # the first stop signal, once one came: an abort exits 128 + it
        self.bound = BoundWatch(bound, abandon, self.signalled, log)  # armed by the first signal, or by the caller
        self._abandon = abandon
        self._cut_short = cut_short
        self._log = log
        self._held = held

    def wrap(self, numbers: tuple[int, ...]) -> None:
        """Inside trio's signal receiver: its handlers, for ``numbers``, run after this guard's."""
        for number in numbers:
            trio_s = signal.getsignal(number)
            signal.signal(number, lambda signum, frame, _then=trio_s: self._heard(signum, frame, _then))

    def _heard(self, number: int, frame: Any, then: Any) -> None:
        if self.signalled:
            exit_now(128 + self.signalled[0], f"a second signal ({signal.Signals(number).name}) during "
                     f"{self._cut_short()}", self._abandon, self._log)
        self.signalled.append(number)
        note_stop_signal()
        self.bound.arm()
        self._held.look(128 + number, self._abandon)
        if callable(then):
            then(number, frame)

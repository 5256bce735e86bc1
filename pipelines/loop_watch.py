"""A watchdog for the deadlines trio cannot keep: a pipeline that blocks trio's thread.

The run's deadlines (:mod:`pipelines.offline_calls`) are trio cancel scopes, which act only when the pipeline's code
gives the loop back. A call that never awaits (``time.sleep``, a busy loop, a synchronous model load in an ``async
def``) inside ``create_session``, ``push_control`` or while making a chunk held ``chunkline run`` for ever. Each wait
for the pipeline is marked here (:func:`waiting`: a tuple written, nothing woken); a daemon thread looks at the mark
only as its deadline passes, and then asks the loop to run a no-op: a loop that does not within
:data:`BLOCK_GRACE` seconds is blocked, and the watchdog's ``on_blocked`` gets the line that names the call.

A stop signal asks at once (:func:`probe`): a stop in order needs the loop, and a first Ctrl-C while a synchronous
model load held it waited out the load's whole deadline (600 s) to say so.

A server, which waits for no call of its own, has its loop looked at once a second instead (``on_held``): held for
:data:`HELD_WARNING` seconds, it is said where (then each :data:`HELD_REPEAT` seconds), and again once the loop is
free. A held server answered nothing, health included, and logged nothing to say why.
"""

from __future__ import annotations

import itertools
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

__all__ = ["BLOCK_GRACE", "LoopWatchdog", "blocking_code", "probe", "waiting"]

#: seconds a loop past a call's deadline has to answer before it is taken as blocked (a free one answers in ms)
BLOCK_GRACE = 2.0
#: seconds between looks while the run waits for no call (the mark is then None)
IDLE_LOOK = 1.0
#: seconds a server's loop may be held before a warning names the code that holds it, and between warnings after it
HELD_WARNING = 5.0
HELD_REPEAT = 60.0
#: what a held loop's lines advise
_ADVICE = "code that never awaits, as time.sleep or a busy loop: run it with trio.to_thread.run_sync"

_WATCHDOG: trio.lowlevel.RunVar[LoopWatchdog | None] = trio.lowlevel.RunVar("chunkline_loop_watchdog", default=None)
_numbers = itertools.count()


@contextmanager
def waiting(call: str, seconds: float, *, late: str | None = None) -> Iterator[Callable[[], None]]:
    """The run waits up to ``seconds`` for the pipeline's ``call`` (``late``: what it failed to do then, if not to
    return): marked for this run's watchdog, if it has one, until the block ends or the callable it gives is called."""
    watchdog = _WATCHDOG.get()
    mark = (next(_numbers), late or f"{call} did not return within {seconds:g} s", time.monotonic(), seconds, call)

    def done() -> None:
        if watchdog is not None and watchdog.mark is mark:
            watchdog.mark = None

    if watchdog is not None:
        watchdog.mark = mark
    try:
        yield done
    finally:
        done()


def probe() -> None:
    """Have this run's watchdog (if any) see now whether trio's thread answers. For a stop signal's handler, which runs
    on trio's thread between the pipeline's bytecodes: it never waits."""
    try:
        watchdog = _WATCHDOG.get()
    except RuntimeError:  # no trio run on this thread now (before the run, after it)
        return
    if watchdog is not None:
        watchdog.probe()


class LoopWatchdog:
    """Ends the run through ``on_blocked(line)`` (which must not return) when trio's thread is blocked past the
    deadline of the call it waits for, or when asked (:meth:`probe`). Started in the trio run (:meth:`start`), stopped
    as the run ends."""

    def __init__(self, on_blocked: Callable[[str], object], grace: float = BLOCK_GRACE, *,
                 cannot: str = "the run could not stop in order", on_held: Callable[[str], object] | None = None) -> None:
        self.mark: tuple[int, str, float, float, str] | None = None  # (number, what is late, since, seconds, call)
        self._on_blocked = on_blocked
        self._grace = grace
        self._cannot = cannot  # what a blocked loop keeps a stop from doing, as the line says it
        self._on_held = on_held  # told when the loop has been held a while, and when it is free again
        self._free_at: float | None = None  # when the loop last answered a look (with ``on_held``)
        self._loop_thread: int | None = None  # trio's thread, whose code a probe's line names
        self._stop_asked: Callable[[], bool] | None = None  # read while idle: a stop asked without a signal
        self._stopped = threading.Event()
        self._wake = threading.Event()  # stopped, or a probe asked for
        self._probe_asked = False
        self._answered = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Watch this trio run's waits for the pipeline (call from inside the run)."""
        token = trio.lowlevel.current_trio_token()
        _WATCHDOG.set(self)
        self._loop_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, args=(token,), name="chunkline-loop-watchdog", daemon=True)
        self._thread.start()

    def probe(self) -> None:
        """Look at the loop now, whatever the call's deadline (never waits: a signal handler calls it)."""
        self._probe_asked = True
        self._wake.set()

    def probe_when(self, stop_asked: Callable[[], bool]) -> None:
        """Look at the loop once ``stop_asked()`` (read on this watchdog's thread about once a second) is true: a stop
        that comes without a signal to this process (hypercorn's supervisor's word)."""
        self._stop_asked = stop_asked

    def stop(self) -> None:
        """Stop watching; the thread is gone when this returns (an exit finds no thread of the run's own)."""
        self._stopped.set()
        self._wake.set()
        self._answered.set()
        if self._thread is not None:
            self._thread.join()

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _loop_answers(self, token: trio.lowlevel.TrioToken) -> bool | None:
        """Whether the loop runs a no-op within the grace; None when the run ended or the watch stopped meanwhile."""
        self._answered = answered = threading.Event()
        if self._stopped.is_set():  # stop() set the event before this one
            return None
        try:
            token.run_sync_soon(answered.set)
        except trio.RunFinishedError:
            return None
        if answered.wait(self._grace):
            return True
        return None if self._stopped.is_set() else False

    def _watch(self, token: trio.lowlevel.TrioToken) -> None:
        while not self._stopped.is_set():
            mark = self.mark
            if self._probe_asked:
                self._probe_asked = False
                asked = time.monotonic()
                answers = self._loop_answers(token)
                if answers is None:
                    return
                if not answers:
                    where = "the pipeline" if mark is None or self.mark is not mark else mark[4]
                    code = blocking_code(self._loop_thread)
                    self._on_blocked(f"pipeline bug: {where}{f' ({code})' if code else ''} has blocked trio's thread "
                                     f"for at least {time.monotonic() - asked:.0f} s, so {self._cannot} ({_ADVICE})")
                    return
                continue
            if mark is None:
                if self._on_held is not None:
                    self._look_for_a_held_loop(token)
                    continue
                self._sleep(IDLE_LOOK)
                self._probe_if_stop_asked()
                continue
            _, late, since, seconds, _ = mark
            left = since + seconds - time.monotonic()
            if left > 0:
                self._sleep(left)
                continue
            asked = time.monotonic()
            answers = self._loop_answers(token)
            if answers is None:
                return
            if answers or self.mark is not mark:
                # the loop runs: trio's own deadline cancels the call; look again while it unwinds
                self._sleep(self._grace)
                continue
            self._on_blocked(f"pipeline bug: {late}: it has blocked trio's thread for at least "
                             f"{time.monotonic() - asked:.0f} s ({_ADVICE})")
            return

    def _probe_if_stop_asked(self) -> bool:
        """A stop asked without a signal (:meth:`probe_when`) becomes a probe; returns whether one did."""
        stop_asked = self._stop_asked
        if stop_asked is None or not stop_asked():
            return False
        self._stop_asked = None
        self._probe_asked = True
        return True

    def _look_for_a_held_loop(self, token: trio.lowlevel.TrioToken) -> None:
        """Have the loop run a no-op, and wait for it while about a second passes (or a stop, or a probe, comes):
        held past :data:`HELD_WARNING`, say where (again each :data:`HELD_REPEAT`), and when it is free again."""
        assert self._on_held is not None
        answered = threading.Event()
        sent = time.monotonic()
        free_at = self._free_at or sent  # the loop was last seen free then: a hold began after it
        try:
            token.run_sync_soon(answered.set)
        except trio.RunFinishedError:
            self._stopped.set()
            return
        warn_at = sent + HELD_WARNING
        held_by = None
        while not answered.wait(IDLE_LOOK / 4):  # a stop or a probe is seen within a quarter of a look
            if self._stopped.is_set() or self._probe_asked or self._probe_if_stop_asked():
                return  # a probe looks again, within its grace
            if time.monotonic() >= warn_at:
                held_by = blocking_code(self._loop_thread) or "code that cannot be seen"
                self._on_held(f"pipeline bug: trio's thread has been held for at least {time.monotonic() - sent:.0f} s by "
                              f"{held_by}; the server answers nothing meanwhile, health included ({_ADVICE})")
                warn_at += HELD_REPEAT
        now = self._free_at = time.monotonic()
        if held_by is not None:
            self._on_held(f"trio's thread is free again, after {now - sent:.0f}-{now - free_at:.0f} s held (last seen in "
                          f"{held_by})")
        self._wake.wait(max(0.0, sent + IDLE_LOOK - time.monotonic()))  # a look about once a second, or a probe now
        self._wake.clear()


_LIBRARIES = tuple({os.path.realpath(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "purelib", "platlib")})
_PIPELINES = os.path.dirname(os.path.realpath(__file__))  # chunkline's pipeline machinery (not the pipelines below it)
_OWN = tuple(os.path.join(os.path.dirname(_PIPELINES), package) + os.sep for package in ("engine", "server", "states"))


def _chunkline_s_own(path: str) -> bool:
    return path.startswith(_OWN) or os.path.dirname(path) == _PIPELINES


def blocking_code(thread: int | None) -> str | None:
    """Where ``thread`` runs now, as ``file.py, line N, in function``: its innermost frame in code neither chunkline's
    nor a library's (the pipeline's own), else its innermost frame; None when it cannot be seen."""
    frame = None if thread is None else sys._current_frames().get(thread)
    innermost = frame
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARIES) and not _chunkline_s_own(path):
            break
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return None
    return f"{os.path.basename(frame.f_code.co_filename)}, line {frame.f_lineno}, in {frame.f_code.co_name}"

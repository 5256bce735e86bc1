"""A command's end that a pipeline's own threads cannot hold.

Python waits at exit for every thread that is not a daemon thread, for ever and deaf to signals (its main
thread waits in C, where no signal handler runs). chunkline's own threads are daemon threads or joined, so one
still running when a command is done was started by the pipeline and never stopped: ``chunkline run`` wrote its
output and then never ended, and ``chunkline stream-serve`` drained on SIGTERM and then stayed, a second SIGTERM
ignored, until a SIGKILL. Such threads get a short grace to end; then one line names them as the pipeline's bug
and the process ends with the command's own exit code, after its exit calls, without waiting for them. Child
processes the pipeline started with ``multiprocessing`` and left running, not daemon processes, get the same grace,
and are then named and ended (multiprocessing's exit call waited for them for ever); so do the other processes it
started and left running (``subprocess.Popen``, a tool run in the background), which outlived the command.

A daemon thread is not waited for, but one still inside native code (a stage call past its ``call_timeout``, left on
its thread; a pipeline's daemon thread in a torch op) aborted the interpreter's last teardown: ``terminate called
without an active exception``, killed by SIGABRT (exit 134) after a run that had said it failed (exit 1). So while
any thread besides the main one runs, the process ends the same way, after its exit calls, without that teardown;
the file objects still open are flushed first, as that teardown would have (a pipeline's file left open lost what
it had written).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engine.supervised_child import descendants, process_gone

from .console import tell

__all__ = ["STRAY_THREAD_GRACE", "adopt_orphans", "end_despite_stray_threads"]

STRAY_THREAD_GRACE = 3.0  # seconds the threads still running as a command ends get to finish on their own
PROCESS_STOP_WAIT = 1.0  # seconds a process left running gets to end after SIGTERM, and then after SIGKILL
FLUSH_WAIT = 2.0  # seconds the files still open get to be flushed as the process ends without its teardown


def adopt_orphans() -> None:
    """Make this process the one that the orphans among its descendants are handed to (Linux's child subreaper), for
    ``chunkline run``: a tool the pipeline left in the background through a shell (``os.system("tool &")``) lost its
    parent as the shell exited and went to init, where the end's look for what the pipeline left never saw it; it
    outlived the run, holding the run's output pipes open (``| tee`` waited for it). Such an orphan that ends before
    the run does stays a zombie until the run's exit (the run is short; a server would gather them)."""
    if sys.platform != "linux":  # pragma: no cover - the project runs on Linux
        return
    import ctypes

    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def _stray(main: threading.Thread) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def _stray_processes() -> list[Any]:
    """The ``multiprocessing`` children still running that are not daemon processes: multiprocessing's exit call
    joins each for ever (a run that had written its output never ended, deaf to Ctrl-C; a SIGTERM ended it with 143
    and left the child running)."""
    module = sys.modules.get("multiprocessing")
    return [] if module is None else [p for p in module.active_children() if not p.daemon]


def _programs_left(known: set[int]) -> dict[int, str]:
    """The processes below this one still running that ``multiprocessing`` does not know of (its children are
    ``known``): a pipeline's ``subprocess.Popen``, ``os.system("tool &")``, a session of its own (``setsid``). By pid,
    each with its name. multiprocessing's resource tracker is left alone: it ends as this process does, and then
    removes what was left registered with it."""
    left: dict[int, str] = {}
    for pid in descendants(os.getpid()):
        if pid in known:
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if not process_gone(pid) and b"multiprocessing.resource_tracker" not in command:
            left[pid] = name
    return left


def _end_programs(prefix: str, left: dict[int, str]) -> None:
    """Say which processes were left, then end them: SIGTERM, and SIGKILL for one still there after a second."""
    names = ", ".join(f"{name!r} (pid {pid})" for pid, name in list(left.items())[:5]) + (", ..." if len(left) > 5 else "")
    tell(f"{prefix}: pipeline bug: {len(left)} process(es) it started still run ({names}) as the command ends; "
         f"ending them (stop them as running() exits)")
    for number in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, number)
        deadline = time.monotonic() + PROCESS_STOP_WAIT
        while (left := _still(left)) and time.monotonic() < deadline:
            time.sleep(0.01)  # they end in milliseconds; bounded by PROCESS_STOP_WAIT


def _still(left: dict[int, str]) -> dict[int, str]:
    """Those of ``left`` still running (not ended, not a zombie)."""
    return {pid: name for pid, name in left.items() if not process_gone(pid)}


def _end_processes(prefix: str, children: list[Any], grace: float) -> None:
    """Say which processes were left, then end them: SIGTERM, and SIGKILL for one still there after a second."""
    names = ", ".join(repr(p.name) for p in children[:5]) + (", ..." if len(children) > 5 else "")
    tell(f"{prefix}: pipeline bug: {len(children)} process(es) it started still run ({names}), not daemon "
         f"processes, {grace:g} s after it closed: Python would wait for them for ever; ending them (stop and join "
         f"them as running() exits, or start them as daemon processes)")
    for child in children:
        child.terminate()
    for child in children:
        child.join(PROCESS_STOP_WAIT)
        if child.is_alive():
            child.kill()
            child.join(PROCESS_STOP_WAIT)


def end_despite_stray_threads(prefix: str, code: int, *, grace: float = STRAY_THREAD_GRACE) -> int:
    """Return ``code`` once no thread but the main one runs (waiting up to ``grace`` for those that are not daemon
    threads); else end the process now with ``code``, its exit calls run first, after saying which threads that are
    not daemon threads were left. Child processes that are not daemons and outlive ``grace`` are named and ended."""
    main = threading.main_thread()
    if threading.current_thread() is not main:
        return code
    deadline = time.monotonic() + grace
    for thread in _stray(main):
        thread.join(max(0.0, deadline - time.monotonic()))
    for process in _stray_processes():
        process.join(max(0.0, deadline - time.monotonic()))
    if children := _stray_processes():
        _end_processes(prefix, children, grace)
    known = {p.pid for p in sys.modules["multiprocessing"].active_children()} if "multiprocessing" in sys.modules else set()
    left = _programs_left(known)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # the grace threads get, for a tool the pipeline ran to end on its own
        left = _still(left)
    if left:
        _end_programs(prefix, left)
    left = _stray(main)
    if left:
        names = ", ".join(repr(t.name) for t in left[:5]) + (", ..." if len(left) > 5 else "")
        # a closed terminal: the line is lost, the end is not
        tell(f"{prefix}: pipeline bug: {len(left)} thread(s) it started still run ({names}), not daemon threads, "
             f"{grace:g} s after it closed: Python would wait for them for ever; ending without them (stop and "
             f"join them as running() exits, or start them as daemon threads)")
    elif not any(t is not main and t.is_alive() for t in threading.enumerate()):
        return code
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    atexit._run_exitfuncs()  # what a normal exit runs after its wait for threads: logging's flush, folders, segments
    _flush_open_files(FLUSH_WAIT)
    os._exit(code)


def _flush_open_files(within: float) -> None:
    """Flush every file object still open, as the interpreter's teardown would have as it closed them (``os._exit``
    skips that: what a pipeline had written to a file it left open was lost), in a daemon thread given ``within``
    seconds: a file whose lock a thread still running holds, blocked in a write, must not hold the end."""
    # by type(), not isinstance(): that reads each object's __class__, which some answer with a warning (torch's
    # deprecated reduce_op), said on stderr after the run's last line
    found = [each for each in gc.get_objects() if issubclass(type(each), _FLUSHED)]
    found.sort(key=lambda each: not issubclass(type(each), io.TextIOWrapper))  # text first: it writes to its buffer
    flushing = threading.Thread(target=_flush_each, args=(found,), name="chunkline-exit-flush", daemon=True)
    flushing.start()
    flushing.join(within)


_FLUSHED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _flush_each(found: list[Any]) -> None:
    for each in found:
        try:
            if not each.closed:
                each.flush()
        except (OSError, ValueError):  # a closed pipe, a full disk, a file detached from its buffer
            pass

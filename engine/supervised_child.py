"""The first thing a child of :class:`engine.supervisor.Supervisor` does: bind its life to its parent's.

Linux's parent-death signal (SIGKILL when the thread that spawned the child
ends) plus a watchdog thread that notices ``os.getppid()`` changing, for where
the signal is not available or was not asked for. Standard library only: it
runs in the child before anything else is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

__all__ = ["PARENT_GONE_EXIT_CODE", "bind_to_parent"]

PARENT_GONE_EXIT_CODE = 70  # a child's exit code when its parent died first
WATCHDOG_INTERVAL = 0.2  # seconds between the child's checks that its parent lives
_PR_SET_PDEATHSIG = 1


def bind_to_parent(config: dict[str, Any]) -> None:
    """First thing in a supervised child: die with the parent (parent-death signal plus a watchdog).

    Exits at once with :data:`PARENT_GONE_EXIT_CODE` when the parent is already gone.
    """
    parent_pid = config["parent_pid"]
    if config.get("parent_death_signal", True):
        _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(PARENT_GONE_EXIT_CODE)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when the thread that spawned it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl; the watchdog still runs
        pass


def _watch_parent(parent_pid: int) -> None:
    pause = threading.Event()  # never set: the wait is just the poll interval
    while os.getppid() == parent_pid:
        pause.wait(WATCHDOG_INTERVAL)
    os._exit(PARENT_GONE_EXIT_CODE)

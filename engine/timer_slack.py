"""Ask the kernel to end a stage thread's timed waits when asked, not up to 50 us later.

Linux lets the kernel fire a thread's timers late by up to its *timer slack* (50 us by
default) to batch wake-ups and save power. A stage thread's handler waits on timers (a
``time.sleep``, a timed poll on an accelerator, a queue wait with a timeout) and every
microsecond it oversleeps is added to the chunk's latency, once per stage, so each
dedicated stage thread asks for the least slack (1 ns) when it starts. Elsewhere (other
systems, or a kernel that refuses) the thread keeps what it has: the call only lowers
latency, never changes behaviour.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["STAGE_TIMER_SLACK_NS", "set_thread_timer_slack"]

STAGE_TIMER_SLACK_NS = 1
_PR_SET_TIMERSLACK = 29  # <linux/prctl.h>

_libc: ctypes.CDLL | None = None


def _prctl() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        # the process's own symbols, libc's among them: ``ctypes.util.find_library`` would run
        # ``ldconfig -p`` in a child process, forked from a process whose threads already run
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    return _libc


def set_thread_timer_slack(nanoseconds: int) -> bool:
    """Set the calling thread's timer slack; False where the system has none to set."""
    libc = _prctl()
    if libc is None:
        return False
    return libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), 0, 0, 0) == 0

"""An agent that a launcher started ends with the authority that started it.

``--workers local`` starts its agents as child processes. Killed with SIGKILL, the authority
cannot stop them; left running, they dialed its port for minutes holding their models, and a
restarted authority took them as extra workers of slots it had filled with its own agents. Each
such agent is told its launcher's pid (``--launcher-pid``) and waits for that process to exit.
"""

from __future__ import annotations

import os

import trio

from engine.supervised_child import PARENT_GONE_EXIT_CODE

__all__ = ["LAUNCHER_GONE_EXIT_CODE", "launcher_gone"]

LAUNCHER_GONE_EXIT_CODE = PARENT_GONE_EXIT_CODE  # as the engine's own children exit when their parent died
POLL_INTERVAL = 0.5  # seconds between checks where a pidfd is not available


async def launcher_gone(pid: int) -> None:
    """Return once process ``pid``, this agent's parent when it started, has exited."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (an old kernel): look at the parent pid now and then
        pidfd = None
    if pidfd is not None:
        try:
            if os.getppid() == pid:  # alive once the pidfd was open: the pidfd turns readable when it exits
                await trio.lowlevel.wait_readable(pidfd)
        finally:
            trio.lowlevel.notify_closing(pidfd)
            os.close(pidfd)
        return
    while os.getppid() == pid:
        await trio.sleep(POLL_INTERVAL)

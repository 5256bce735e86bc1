"""A supervised child's life bound to its parent's, from both ends.

The child's end, the first thing a child of :class:`engine.supervisor.Supervisor` does
(:func:`bind_to_parent`): Linux's parent-death signal (SIGKILL when the thread that spawned the
child ends) plus a watchdog thread that notices ``os.getppid()`` changing, for where the signal
is not available or was not asked for. Standard library only: it runs in the child before
anything else is imported.

A child whose parent decides when it stops (a rank, a service child) also ignores the stop signals
that reach a whole process group (:data:`GROUP_STOP_SIGNALS`, :func:`ignore_group_stop_signals`):
systemd's default ``KillMode=control-group``, ``kill -TERM -PGID``, Ctrl-C and a closed terminal's
SIGHUP signal every process of the server, and a rank that died of it failed the session its
server was draining. Such a child still ends by its parent's goodbye, by SIGKILL from the
supervisor's escalation, or by the parent-death signal.

Each such child leads a process group of its own (:func:`bind_to_parent`): its supervisor kills the group when
it kills the child and once the child has exited (:func:`end_process_group`), so the processes the child started
end with it.

The parent's end, for a process about to end at once with ``os._exit`` (a second stop signal)
(:func:`end_descendants_now`): the parent-death signal alone left work behind. It kills only the
spawner's direct children, and the shared memory they made stayed in /dev/shm; their own
children (a service child's ranks) were reparented and lived on until they reached their own
:func:`bind_to_parent`, seconds later while they still imported torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "GROUP_STOP_SIGNALS",
    "PARENT_GONE_EXIT_CODE",
    "bind_to_parent",
    "descendants",
    "end_descendants_now",
    "end_process_group",
    "ignore_group_stop_signals",
    "process_gone",
    "stop_signals_held_for_the_child",
]

PARENT_GONE_EXIT_CODE = 70  # a child's exit code when its parent died first
WATCHDOG_INTERVAL = 0.2  # seconds between the child's checks that its parent lives
#: seconds :func:`end_descendants_now` waits for the processes it killed to be gone (SIGKILL takes milliseconds)
KILLED_WAIT = 2.0
_PR_SET_PDEATHSIG = 1
#: the stop signals a service manager or a terminal sends to every process of a group; a child whose parent decides
#: when it stops ignores them (its parent drains its sessions first, then says goodbye)
GROUP_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def ignore_group_stop_signals() -> None:
    """Ignore :data:`GROUP_STOP_SIGNALS` in this process (and in what it spawns: an ignored signal stays ignored
    across ``exec``). Its end is then its parent's goodbye, SIGKILL, or the parent-death signal."""
    for number in GROUP_STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_held_for_the_child() -> Iterator[None]:
    """Spawn inside this: the child starts with :data:`GROUP_STOP_SIGNALS` held (blocked) until its
    :func:`bind_to_parent`, which takes them (or drops them, where it ignores them).

    A spawned child unpickles what it runs before it runs any of it, and that imports its modules (a pipeline's:
    torch, seconds of it). A Ctrl-C from a terminal reaches every process of the group: the children still importing
    died of it, each printing a ``KeyboardInterrupt`` traceback, though they are to ignore it. The mask is the
    spawning thread's own (a blocked signal goes to another thread of this process), and a child inherits it.
    The resource tracker is started first: starting it unblocks SIGINT and SIGTERM on the thread that does.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def bind_to_parent(config: dict[str, Any]) -> None:
    """First thing in a supervised child: die with the parent (parent-death signal plus a watchdog), and lead a
    process group of its own, which the supervisor kills with the child: what the child starts (a model's
    compile workers, a tool it runs) ends with it instead of living on, reparented, once the child is gone.

    Exits at once with :data:`PARENT_GONE_EXIT_CODE` when the parent is already gone.
    """
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover - a session leader cannot move; its group is then its session's
        pass
    # out of the terminal's foreground group now: with ``stty tostop`` a write to the terminal (a log line) would
    # stop the child; ignored, the write goes through as it did in the parent's group
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    # held since the spawn (:func:`stop_signals_held_for_the_child`): one that came meanwhile is taken now, or dropped
    # where the child ignores it (:func:`ignore_group_stop_signals`, called before this)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_STOP_SIGNALS)
    _keep_passed_descriptors_to_itself()
    parent_pid = config["parent_pid"]
    if config.get("parent_death_signal", True):
        _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(PARENT_GONE_EXIT_CODE)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _keep_passed_descriptors_to_itself() -> None:
    """Make the descriptors the spawn passed this child (its pipe to the parent, the end whose close tells the parent it
    exited, the resource tracker's) non-inheritable, as every descriptor Python opens is: a process the child starts
    (``os.system("tool &")``, a fork) held them open past the child's death, and the parent never saw it die."""
    try:
        opened = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # pragma: no cover - no /proc: the common low range
        opened = list(range(3, 256))
    for fd in opened:
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # the listing's own descriptor, closed by now, or not one this process holds
                pass


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


def _parents(proc: str = "/proc") -> dict[int, int]:
    """Every process's parent, from ``/proc/<pid>/stat`` (its 4th field, after the command name in parentheses)."""
    found = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):  # it ended meanwhile
            continue
        found[int(entry)] = int(fields[1])
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first); empty where there is no ``/proc``."""
    try:
        parents = _parents()
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def process_gone(pid: int) -> bool:
    """Ended: no longer in ``/proc``, or a zombie (it can make nothing more; its parent reaps it, or init)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def end_descendants_now(wait: float = KILLED_WAIT) -> list[int]:
    """Kill every process below this one and remove the shared memory they made; returns their pids.

    Each is stopped first (SIGSTOP), the tree walked again until no new one appears, then all are killed at
    once: killed top-down, a grandchild was reparented away before the walk reached it, and a child still
    spawning added one the walk never saw. Waits (at most ``wait`` seconds) until they are gone, so that no
    segment is made after its maker's segments were removed. For a process about to end with ``os._exit``."""
    from .shm_names import remove_segments_of  # standard library only too; not needed by a child that binds

    me, stopped = os.getpid(), []
    for _ in range(16):  # a tree deeper than this is not one the project spawns
        new = [pid for pid in descendants(me) if pid not in stopped]
        if not new:
            break
        for pid in new:
            _send(pid, signal.SIGSTOP)
        stopped += new
    for pid in stopped:
        _send(pid, signal.SIGKILL)
    give_up = time.monotonic() + wait
    pause = threading.Event()  # never set: the wait is just the poll interval
    while not all(process_gone(pid) for pid in stopped) and time.monotonic() < give_up:
        pause.wait(0.005)
    for pid in stopped:
        remove_segments_of(pid)
    return stopped


def end_process_group(leader: int) -> bool:
    """SIGKILL the process group a supervised child leads (the child too, if it still runs); False when there is no
    such group (the child never reached :func:`bind_to_parent`, or nothing of it is left).

    Call it before the child is reaped: until then its pid, and so its group's id, cannot be reused, and the
    group lives on after the child as long as one of its processes does."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _send(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except OSError:  # it ended meanwhile (or is not ours to signal)
        pass

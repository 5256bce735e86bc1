"""Shared helpers of the reliability tests: leak checks, real-time waits, a raw WebSocket client.

Leak checks (:class:`Leaks`) compare against a baseline taken at the start of a test, inside its
trio run:

- threads: every thread alive at the end must have been alive at the start, except idle trio
  worker-cache threads. ``trio.to_thread.run_sync`` parks its finished threads in a process-wide
  cache for up to 10 s (named ``Trio thread N`` while idle; a thread running a job carries the
  job's name), so an idle cache thread is reuse, not an orphan. With ``foreign_threads_ok`` (the
  LiveKit test), ``Dummy-N`` entries are ignored too: those are native threads of the LiveKit SDK's
  process-wide Rust runtime that called back into Python (Python registers them as
  ``threading._DummyThread`` for good); the product neither starts nor can join them;
- child processes: ``multiprocessing.active_children()`` is empty and none of the known pids exists;
- open files: the count of ``/proc/self/fd`` returns to the baseline within ``fd_slack``. The slack
  absorbs process-wide, created-once resources that a first use opens and keeps (the LiveKit FFI
  runtime's epoll/eventfd descriptors, the toy world's torch thread pool), and descriptors the
  garbage collector has not closed yet (a ``gc.collect()`` runs first). The descriptors that are new
  are listed on failure.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from server.transport.client import RoomClient

REPO_ROOT = Path(__file__).resolve().parents[2]

IDLE_CACHE_THREAD = "Trio thread "


def open_fds() -> dict[int, str]:
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the directory's own descriptor, gone by now
    return out


def extra_threads(baseline: set[threading.Thread], *, foreign_ok: bool = False) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t not in baseline
        and t.is_alive()
        and not t.name.startswith(IDLE_CACHE_THREAD)
        and not (foreign_ok and isinstance(t, threading._DummyThread))  # type: ignore[attr-defined]
    ]


def free_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def process_tree(root: int) -> set[int]:
    """``root`` and every process below it now (by each process's parent in /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree = {root}
    while grown := {pid for pid, parent in parents.items() if parent in tree} - tree:
        tree |= grown
    return tree


STREAM_SERVE = ["-c", "import sys; from server.cli import main; sys.exit(main())", "stream-serve"]
#: every stage of the toy world in a rank process of its own, on the CPU
CPU_PLACEMENT = ('{"mode": "process", "encode": {"devices": ["cpu"]}, "denoise": {"devices": ["cpu"]}, '
                 '"decode": {"devices": ["cpu"]}}')


def stream_serve_command(*arguments: str) -> list[str]:
    """``chunkline stream-serve ARGUMENTS`` through this interpreter (the checkout's code first on its path)."""
    return [sys.executable, *STREAM_SERVE, *arguments]


def stream_serve_env() -> dict[str, str]:
    """This environment without ``CHUNKLINE_*``, with the checkout first on the path and timeouts long enough that no
    session ends on its own while a test signals the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(CHUNKLINE_CONTROLLER_TIMEOUT="3600", CHUNKLINE_ROOM_EMPTY_TIMEOUT="3600",
               PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def channel_segments() -> set[str]:
    """The tensor channels' shared-memory segments now in /dev/shm (``cl_<owner pid>-...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("cl_")}


def segment_owner(segment: str) -> int:
    """The pid of the process that made a channel segment."""
    return int(segment[len("cl_"):].split("-", 1)[0])


def kill_what_is_left(tree: set[int]) -> None:
    """SIGKILL every process of ``tree`` still alive (a test's cleanup after a failure)."""
    for pid in tree:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def processes_left(tree: set[int], deadline: float) -> list[int]:
    """The processes of ``tree`` still alive once ``deadline`` wall seconds passed (or at once when none is)."""
    with trio.move_on_after(deadline):
        while any(pid_alive(pid) for pid in tree):
            await trio.sleep(0.05)  # bench-cost: real-time poll of processes that are not ours to wait on
    return [pid for pid in tree if pid_alive(pid)]


class Leaks:
    """A baseline of threads, child processes and open files; :meth:`check` compares against it."""

    def __init__(self, *, fd_slack: int = 2, foreign_threads_ok: bool = False) -> None:
        gc.collect()
        self.threads = set(threading.enumerate())
        self.fds = open_fds()
        self.children = {p.pid for p in multiprocessing.active_children()}
        self.fd_slack = fd_slack
        self.foreign_threads_ok = foreign_threads_ok

    def problems(self, pids: tuple[int, ...] = ()) -> list[str]:
        gc.collect()
        found: list[str] = []
        threads = extra_threads(self.threads, foreign_ok=self.foreign_threads_ok)
        if threads:
            found.append(f"threads left: {[(t.name, t.daemon) for t in threads]}")
        children = [p for p in multiprocessing.active_children() if p.pid not in self.children]
        if children:
            found.append(f"child processes left: {children}")
        alive = [pid for pid in pids if pid_alive(pid)]
        if alive:
            found.append(f"processes still alive: {alive}")
        fds = open_fds()
        if len(fds) > len(self.fds) + self.fd_slack:
            new = {fd: target for fd, target in fds.items() if self.fds.get(fd) != target}
            found.append(f"{len(fds) - len(self.fds)} more open files than the baseline {len(self.fds)} "
                         f"(slack {self.fd_slack}): {new}")
        return found

    async def check(self, pids: tuple[int, ...] = (), *, wall_deadline: float = 10.0) -> None:
        """Wait (wall clock, bounded) until nothing leaked; threads and processes take a moment to end."""
        give_up = time.monotonic() + wall_deadline
        while True:
            found = self.problems(pids)
            if not found:
                return
            if time.monotonic() > give_up:
                raise AssertionError("; ".join(found))
            await trio.to_thread.run_sync(time.sleep, 0.02)  # bench-cost: bounded poll for threads and processes to end (not trio.sleep: autojump would not wait)


async def wait_until(predicate: Callable[[], Any], what: str, deadline: float = 20.0) -> Any:
    """Wait in real time (threads and processes do the work) until ``predicate()`` is truthy."""
    give_up = time.monotonic() + deadline
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {deadline:g} s waiting for {what}")
        await trio.sleep(0.005)  # bench-cost: real-time poll of other processes/threads, bounded by a deadline


# -- a raw WebSocket client (wsproto over a trio socket) -------------------------------------


# the product's own local-room client (server/transport/client.py)
RawWebSocket = RoomClient


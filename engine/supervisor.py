"""One supervisor for every child process chunkline spawns: spawn, watch, stop, reap.

Both the worker process group (:mod:`engine.workers`, one child per rank) and
the process service (:mod:`server.process_service`, one child per model
worker) own a :class:`Supervisor`. It does the parts that are the same for any
child and easy to get subtly wrong, and leaves the wire format to its owner::

    supervisor = Supervisor([ChildSpec("rank0", child_main, {"rank": 0})],
                            on_message=handle, on_exit=reaped, close_timeout=10, kill_grace=2)
    supervisor.start(timeout=60, check_hello=accept)   # blocking; raises StartupFailed
    supervisor.send(0, data)                            # bytes; False when the child is gone
    supervisor.stop(goodbye_bytes)                      # polite, then SIGTERM, then SIGKILL
    supervisor.wait_closed()                            # every child reaped, every pipe closed

- **Spawn** from one *monitor* thread per supervisor (a ``spawn`` context; Linux's
  parent-death signal fires when the *spawning thread* ends, so that thread must
  outlive its children). The child calls
  :func:`engine.supervised_child.bind_to_parent` first thing: the parent-death
  signal plus a watchdog thread that notices the parent is gone.
- **Hello**: a child's first message says whether it is ready; ``check_hello``
  (run on the monitor thread) raises to refuse it. :meth:`Supervisor.start`
  returns once every child was accepted, or raises :class:`StartupFailed` after
  killing and reaping every child.
- **Watch**: the monitor reads every pipe (``on_message(index, data)``, monitor
  thread) and waits on every sentinel; a child is reaped as soon as it exits and
  ``on_exit(ChildExit)`` says how (``expected`` when a stop had been asked for).
- **Stop** is bounded: the owner's goodbye message, then SIGTERM after
  ``close_timeout``, then SIGKILL ``kill_grace`` later (the escalation is the
  table in :mod:`states.child_process`). chunkline's own children (ranks, service
  children) ignore SIGTERM, as a signal to the whole process group must not end
  them (:func:`engine.supervised_child.ignore_group_stop_signals`): for them the
  SIGTERM step is only a wait, and SIGKILL ends what the goodbye did not.
- **Heartbeat deadline** (``heartbeat_timeout``): a running child that sends
  nothing for that long is killed, with that cause in its :class:`ChildExit`. The
  child side must then send something (a heartbeat) at least that often.
- **Send deadline** (``send(..., timeout=)``): a write still blocked on a child's
  full pipe after that long kills the child (a child that reads nothing, e.g.
  one stopped with SIGSTOP, would otherwise hold the sender until the close).
- **Replace on failure**: :meth:`Supervisor.respawn` spawns a fresh child into the
  slot of one that exited (from ``on_exit``'s caller's side, never on the monitor
  thread); a restart *policy* (backoff, crash-loop limit) belongs in ``states/``.

This module is the owner's side (start, respawn, send, stop, kill, close);
the monitor thread that does the spawning, reading, signalling and reaping is
:mod:`engine.child_monitor`. Thread-safe; knows nothing of trio.
"""


from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from states.child_process import LIVE, Event, State

from .child_monitor import ChildExit, ChildMonitor, ChildSpec
from .errors import EngineError, message_of, shown

__all__ = [
    "ChildExit",
    "ChildSpec",
    "StartupFailed",
    "StartupProblem",
    "Supervisor",
    "SupervisorError",
]

log = logging.getLogger("chunkline.supervisor")


class SupervisorError(EngineError, RuntimeError):
    """Base of the supervisor's errors."""


class StartupProblem:
    """Why :meth:`Supervisor.start` failed (the ``problem`` of a :class:`StartupFailed`)."""

    SPAWN_FAILED = "spawn_failed"  # the process could not be created (e.g. the target does not pickle)
    EXITED = "exited"  # it exited before saying hello
    TIMED_OUT = "timed_out"  # some children were not ready in time
    REFUSED = "refused"  # check_hello refused its hello (``cause`` is what it raised)


class StartupFailed(SupervisorError):
    """The children did not all start; every one of them has been killed and reaped.

    ``problem`` is a :class:`StartupProblem` value; ``index``, ``pid`` and ``exitcode``
    name the child at fault (``waiting`` the late ones for a timeout); ``__cause__``
    is what ``check_hello`` raised for a refusal.
    """

    def __init__(
        self, message: str, *, problem: str, index: int | None = None, pid: int | None = None,
        exitcode: int | None = None, waiting: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.problem = problem
        self.index = index
        self.pid = pid
        self.exitcode = exitcode
        self.waiting = waiting



class Supervisor:
    """Spawns, watches, stops and reaps a fixed set of child slots (see the module docs)."""

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        on_message: Callable[[int, bytes], None],
        on_exit: Callable[[ChildExit], None],
        close_timeout: float = 10.0,
        kill_grace: float = 2.0,
        heartbeat_timeout: float | None = None,
        parent_death_signal: bool = True,
        name: str = "supervisor",
    ) -> None:
        if not children:
            raise ValueError("a supervisor needs at least one child")
        if heartbeat_timeout is not None and heartbeat_timeout <= 0:
            raise ValueError(f"heartbeat_timeout must be > 0 seconds or None, got {heartbeat_timeout!r}")
        self.name = name
        self.close_timeout = close_timeout
        self.kill_grace = kill_grace
        self.heartbeat_timeout = heartbeat_timeout
        self._monitor = ChildMonitor(
            children, on_message=on_message, on_exit=on_exit, kill_grace=kill_grace,
            heartbeat_timeout=heartbeat_timeout, parent_death_signal=parent_death_signal, name=name,
        )
        # the record shared with the monitor thread (change it only under the lock)
        self._slots = self._monitor.slots
        self._lock = self._monitor.lock
        self._changed = self._monitor.changed

    # -- facts -----------------------------------------------------------------------------

    @property
    def pids(self) -> tuple[int | None, ...]:
        """Each slot's current (or last) process id; None before its first spawn."""
        with self._lock:
            return tuple(slot.pid for slot in self._slots)

    def state(self, index: int) -> State:
        """The child's lifecycle state (:mod:`states.child_process`)."""
        with self._lock:
            return self._slots[index].life.state

    def on_monitor_thread(self) -> bool:
        """Whether the caller is the monitor thread (where ``on_message`` and ``on_exit`` run)."""
        return self._monitor.is_current()

    @property
    def finished(self) -> bool:
        """The monitor has ended: every child reaped, every pipe closed."""
        return self._monitor.finished.is_set()

    # -- start and respawn -----------------------------------------------------------------

    def start(self, timeout: float, check_hello: Callable[[int, bytes], None] | None = None) -> None:
        """Spawn every child and wait until each has said hello and ``check_hello`` accepted it.

        Blocking. Raises :class:`StartupFailed` once every child has been killed
        and reaped (the supervisor is then finished).
        """
        self._monitor.start(check_hello)
        self._await_hellos(range(len(self._slots)), timeout)

    def respawn(self, index: int, timeout: float) -> None:
        """Spawn a fresh child into slot ``index``, whose child has exited; wait for its hello.

        The hook for replacing a failed child (call it from the owner's side, not
        from ``on_exit``, which runs on the monitor thread). Raises
        :class:`StartupFailed` (the other children are left alone) or
        :class:`SupervisorError` when the slot's child still lives or the
        supervisor is stopping.
        """
        if self.on_monitor_thread():
            raise RuntimeError(f"{self.name}: respawn() cannot run on the monitor thread")
        monitor = self._monitor
        with self._lock:
            slot = self._slots[index]
            if monitor.stopping or monitor.finished.is_set() or not monitor.started:
                raise SupervisorError(f"{self.name}: cannot respawn child {index}: the supervisor is stopping")
            if slot.life.state in LIVE:
                raise SupervisorError(f"{self.name}: cannot respawn child {index}: it has not exited")
            monitor.spawn_requests.append(index)
            slot.spawn_due, slot.hello = True, False
        monitor.wake()
        self._await_hellos((index,), timeout, kill_all=False)

    def _await_hellos(self, indices: Sequence[int] | range, timeout: float, *, kill_all: bool = True) -> None:
        deadline = time.monotonic() + timeout
        wanted = tuple(indices)
        with self._changed:
            while True:
                failure = self._startup_failure(wanted)
                if failure is not None:
                    break
                waiting = tuple(i for i in wanted if not self._slots[i].hello)
                if not waiting:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    failure = StartupFailed(
                        f"{self.name}: children {list(waiting)} not ready within {timeout:g}s",
                        problem=StartupProblem.TIMED_OUT, waiting=waiting,
                    )
                    break
                self._changed.wait(remaining)
        victims = range(len(self._slots)) if kill_all else wanted
        for index in victims:
            self.kill(index, cause="its start failed")
        if kill_all:
            self.stop(None, timeout=0.0)
            self.wait_closed()
        else:
            self._await_reaped(wanted)
        raise failure

    def _startup_failure(self, wanted: tuple[int, ...]) -> StartupFailed | None:
        """Under the lock: why the start of ``wanted`` already failed, or None."""
        spawn_error, refusal = self._monitor.spawn_error, self._monitor.refusal
        if spawn_error is not None and spawn_error[0] in wanted:
            index, exc = spawn_error
            failure = StartupFailed(
                f"{self.name}: could not start child {index}: {shown(exc, limit=None)}", problem=StartupProblem.SPAWN_FAILED, index=index,
            )
            failure.__cause__ = exc
            return failure
        if refusal is not None and refusal[0] in wanted:
            index, exc = refusal
            slot = self._slots[index]
            failure = StartupFailed(
                f"{self.name}: child {index} (pid {slot.pid}) refused to start: {message_of(exc)}",
                problem=StartupProblem.REFUSED, index=index, pid=slot.pid,
            )
            failure.__cause__ = exc
            return failure
        for index in wanted:
            slot = self._slots[index]
            if slot.life.state not in LIVE and not slot.spawn_due:  # even after its hello: start() has not returned
                return StartupFailed(
                    f"{self.name}: child {index} (pid {slot.pid}) exited during startup with code {slot.exitcode}",
                    problem=StartupProblem.EXITED, index=index, pid=slot.pid, exitcode=slot.exitcode,
                )
        return None

    def _await_reaped(self, indices: Sequence[int]) -> None:
        bound = self.kill_grace + 5.0
        with self._changed:
            self._changed.wait_for(lambda: all(self._slots[i].life.state not in LIVE for i in indices), bound)

    # -- used by the owner (any thread) -------------------------------------------------------

    def send(self, index: int, data: bytes, *, timeout: float | None = None) -> bool:
        """Write one message to child ``index``; False when it is gone (``on_exit`` says how).

        A write still blocked after ``timeout`` seconds (the child reads nothing: its pipe is full) kills the child,
        which ends the write: a child that takes in no message for that long is of no use, and the half-written
        message would leave its pipe unreadable anyway."""
        slot = self._slots[index]
        with slot.send_lock:  # this child's pipe only: a full pipe here holds up no other child
            if not slot.conn_open or slot.conn is None:
                return False
            if timeout is not None:
                slot.send_timeout, slot.send_due = timeout, time.monotonic() + timeout  # the monitor watches it
            try:
                slot.conn.send_bytes(data)
            except OSError:
                return False
            finally:
                slot.send_due = None
        return True

    def stop(self, goodbye: bytes | None, *, timeout: float | None = None) -> None:
        """Ask every live child to leave (non-blocking); then SIGTERM after ``timeout``, SIGKILL ``kill_grace`` later.

        ``goodbye`` is written to each child (from a helper thread, so a full pipe
        cannot block the caller); ``timeout`` defaults to ``close_timeout``.
        Idempotent: a second call changes no deadline.
        """
        now = time.monotonic()
        timeout = self.close_timeout if timeout is None else timeout
        monitor = self._monitor
        with self._lock:
            first, monitor.stopping = not monitor.stopping, True
            for slot in self._slots:
                if slot.life.can(Event.STOP):
                    slot.life.apply(Event.STOP)
                    slot.stop_at, slot.stop_timeout = now, timeout
            for index in monitor.spawn_requests:  # never spawned now
                self._slots[index].spawn_due = False
            monitor.spawn_requests = []
        if first and goodbye is not None:
            threading.Thread(target=self._send_goodbye, args=(goodbye,), name=f"{self.name}-goodbye", daemon=True).start()
        monitor.wake()

    def kill(self, index: int, *, cause: str | None = None) -> None:
        """SIGKILL child ``index`` now (non-blocking; the monitor sends it and reaps the child)."""
        self._monitor.request_kill(index, cause)

    def wait_closed(self) -> None:
        """Wait until every child is reaped and the monitor has ended (bounded once ``stop`` was called)."""
        monitor = self._monitor
        if not monitor.started:
            monitor.finished.set()
            return
        bound = self.close_timeout + 3 * self.kill_grace + 5.0
        if not monitor.finished.wait(bound):  # pragma: no cover - a SIGKILL that did not take
            log.error("%s: children %s still not reaped after %gs", self.name, self.pids, bound)
        monitor.join(bound)

    def close(self, goodbye: bytes | None = None, *, timeout: float | None = None) -> None:
        """``stop`` then ``wait_closed`` (blocking, bounded, idempotent)."""
        if not self._monitor.started:
            self._monitor.finished.set()
            return
        self.stop(goodbye, timeout=timeout)
        self.wait_closed()

    def _send_goodbye(self, data: bytes) -> None:
        for slot in self._slots:
            if not slot.send_lock.acquire(timeout=self.close_timeout):
                continue  # a send to this child is stuck: SIGTERM and SIGKILL come next
            try:
                if slot.conn_open and slot.conn is not None:
                    try:
                        slot.conn.send_bytes(data)
                    except OSError:
                        pass
            finally:
                slot.send_lock.release()

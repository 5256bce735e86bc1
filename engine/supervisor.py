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
  table in :mod:`states.child_process`).
- **Heartbeat deadline** (``heartbeat_timeout``): a running child that sends
  nothing for that long is killed, with that cause in its :class:`ChildExit`. The
  child side must then send something (a heartbeat) at least that often.
- **Replace on failure**: :meth:`Supervisor.respawn` spawns a fresh child into the
  slot of one that exited (from ``on_exit``'s caller's side, never on the monitor
  thread); a restart *policy* (backoff, crash-loop limit) belongs in ``states/``.

Thread-safe; knows nothing of trio.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as wait_ready
from typing import Any

import attrs

from states.child_process import HEARTBEAT_WATCHED, LIVE, ChildProcessMachine, Event, State, due_signal

from .errors import EngineError

__all__ = [
    "ChildExit",
    "ChildSpec",
    "StartupFailed",
    "StartupProblem",
    "Supervisor",
    "SupervisorError",
]

log = logging.getLogger("chunkline.supervisor")

MONITOR_POLL = 0.1  # seconds between the monitor's checks of its deadlines
PIPE_CLOSED_GRACE = 1.0  # seconds a child that closed its pipe gets to exit before it is killed


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


@attrs.frozen
class ChildSpec:
    """One child to spawn: ``target(conn, config)`` runs in it (both must pickle).

    The supervisor adds ``parent_pid`` and ``parent_death_signal`` to ``config``
    for :func:`engine.supervised_child.bind_to_parent`. ``daemon`` children cannot spawn processes of their own.
    """

    name: str
    target: Callable[[Any, dict[str, Any]], None]
    config: dict[str, Any] = attrs.field(factory=dict)
    daemon: bool = True


@attrs.frozen
class ChildExit:
    """How one child ended: reaped, its pipe closed."""

    index: int
    pid: int | None
    exitcode: int | None
    expected: bool  # a stop had been requested before it exited
    cause: str | None = None  # why the supervisor killed it, when it did so on its own


class _Slot:
    """The monitor's record of one child (only the monitor thread changes it, under the lock)."""

    __slots__ = ("conn", "conn_open", "heard_at", "hello", "life", "pid", "pipe_closed_at", "proc", "spec",
                 "spawn_due", "stop_at", "stop_timeout", "kill_cause", "exitcode")

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.life = ChildProcessMachine(State.EXITED)  # before its first spawn a slot reads as an exited child
        self.spawn_due = False  # a spawn was asked for and has not happened (or failed) yet
        self.proc: Any = None
        self.conn: Any = None
        self.conn_open = False
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.hello = False
        self.heard_at = 0.0
        self.pipe_closed_at: float | None = None
        self.stop_at: float | None = None
        self.stop_timeout = 0.0
        self.kill_cause: str | None = None


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
        self._parent_death_signal = parent_death_signal
        self._on_message = on_message
        self._on_exit = on_exit
        self._slots = [_Slot(spec) for spec in children]
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._spawn_requests: list[int] = []
        self._kill_requests: list[tuple[int, str | None]] = []
        self._check_hello: Callable[[int, bytes], None] = lambda index, data: None
        self._refusal: tuple[int, BaseException] | None = None
        self._spawn_error: tuple[int, BaseException] | None = None
        self._stopping = False
        self._monitor: threading.Thread | None = None
        self._wake_r: Any = None
        self._wake_w: Any = None
        self._finished = threading.Event()

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
        return threading.current_thread() is self._monitor

    @property
    def finished(self) -> bool:
        """The monitor has ended: every child reaped, every pipe closed."""
        return self._finished.is_set()

    # -- start and respawn -----------------------------------------------------------------

    def start(self, timeout: float, check_hello: Callable[[int, bytes], None] | None = None) -> None:
        """Spawn every child and wait until each has said hello and ``check_hello`` accepted it.

        Blocking. Raises :class:`StartupFailed` once every child has been killed
        and reaped (the supervisor is then finished).
        """
        with self._lock:
            if self._monitor is not None:
                raise RuntimeError(f"{self.name}: a supervisor starts once")
            if check_hello is not None:
                self._check_hello = check_hello
            self._wake_r, self._wake_w = multiprocessing.get_context("spawn").Pipe(duplex=False)
            self._spawn_requests = list(range(len(self._slots)))
            for slot in self._slots:
                slot.spawn_due = True
            self._monitor = threading.Thread(target=self._run, name=f"{self.name}-monitor", daemon=True)
        self._monitor.start()
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
        with self._lock:
            slot = self._slots[index]
            if self._stopping or self._finished.is_set() or self._monitor is None:
                raise SupervisorError(f"{self.name}: cannot respawn child {index}: the supervisor is stopping")
            if slot.life.state in LIVE:
                raise SupervisorError(f"{self.name}: cannot respawn child {index}: it has not exited")
            self._spawn_requests.append(index)
            slot.spawn_due, slot.hello = True, False
        self._wake()
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
        if self._spawn_error is not None and self._spawn_error[0] in wanted:
            index, exc = self._spawn_error
            failure = StartupFailed(
                f"{self.name}: could not start child {index}: {exc!r}", problem=StartupProblem.SPAWN_FAILED, index=index,
            )
            failure.__cause__ = exc
            return failure
        if self._refusal is not None and self._refusal[0] in wanted:
            index, exc = self._refusal
            slot = self._slots[index]
            failure = StartupFailed(
                f"{self.name}: child {index} (pid {slot.pid}) refused to start: {exc}",
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

    def send(self, index: int, data: bytes) -> bool:
        """Write one message to child ``index``; False when it is gone (``on_exit`` says how)."""
        with self._send_lock:
            slot = self._slots[index]
            if not slot.conn_open or slot.conn is None:
                return False
            try:
                slot.conn.send_bytes(data)
            except OSError:
                return False
        return True

    def stop(self, goodbye: bytes | None, *, timeout: float | None = None) -> None:
        """Ask every live child to leave (non-blocking); then SIGTERM after ``timeout``, SIGKILL ``kill_grace`` later.

        ``goodbye`` is written to each child (from a helper thread, so a full pipe
        cannot block the caller); ``timeout`` defaults to ``close_timeout``.
        Idempotent: a second call changes no deadline.
        """
        now = time.monotonic()
        timeout = self.close_timeout if timeout is None else timeout
        with self._lock:
            first, self._stopping = not self._stopping, True
            for slot in self._slots:
                if slot.life.can(Event.STOP):
                    slot.life.apply(Event.STOP)
                    slot.stop_at, slot.stop_timeout = now, timeout
            for index in self._spawn_requests:  # never spawned now
                self._slots[index].spawn_due = False
            self._spawn_requests = []
        if first and goodbye is not None:
            threading.Thread(target=self._send_goodbye, args=(goodbye,), name=f"{self.name}-goodbye", daemon=True).start()
        self._wake()

    def kill(self, index: int, *, cause: str | None = None) -> None:
        """SIGKILL child ``index`` now (non-blocking; the monitor sends it and reaps the child)."""
        with self._lock:
            self._kill_requests.append((index, cause))
        self._wake()

    def wait_closed(self) -> None:
        """Wait until every child is reaped and the monitor has ended (bounded once ``stop`` was called)."""
        monitor = self._monitor
        if monitor is None:
            self._finished.set()
            return
        bound = self.close_timeout + 3 * self.kill_grace + 5.0
        if not self._finished.wait(bound):  # pragma: no cover - a SIGKILL that did not take
            log.error("%s: children %s still not reaped after %gs", self.name, self.pids, bound)
        monitor.join(bound)

    def close(self, goodbye: bytes | None = None, *, timeout: float | None = None) -> None:
        """``stop`` then ``wait_closed`` (blocking, bounded, idempotent)."""
        if self._monitor is None:
            self._finished.set()
            return
        self.stop(goodbye, timeout=timeout)
        self.wait_closed()

    def _send_goodbye(self, data: bytes) -> None:
        for index in range(len(self._slots)):
            if not self._send_lock.acquire(timeout=self.close_timeout):
                return  # a send is stuck: SIGTERM and SIGKILL come next
            try:
                slot = self._slots[index]
                if slot.conn_open and slot.conn is not None:
                    try:
                        slot.conn.send_bytes(data)
                    except OSError:
                        pass
            finally:
                self._send_lock.release()

    def _wake(self) -> None:
        if self._wake_w is None:
            return
        try:
            self._wake_w.send_bytes(b"x")
        except OSError:
            pass

    # -- the monitor thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException as exc:  # a bug here must not leave children unwatched
            log.exception("%s: the monitor thread crashed", self.name)
            self._abandon(f"the supervisor's monitor thread crashed: {exc!r}")
        finally:
            with self._changed:
                self._changed.notify_all()
            if self._wake_r is not None:
                self._wake_r.close()
                self._wake_w.close()
            self._finished.set()

    def _watch(self) -> None:
        while True:
            self._handle_requests()
            with self._lock:
                slots = list(enumerate(self._slots))
                if self._stopping and all(slot.life.state not in LIVE for _, slot in slots) and not self._spawn_requests:
                    return
            conns = {slot.conn: index for index, slot in slots if slot.conn_open}
            sentinels = {slot.proc.sentinel: index for index, slot in slots if slot.life.state in LIVE}
            for ready in wait_ready([self._wake_r, *conns, *sentinels], MONITOR_POLL):
                if ready is self._wake_r:
                    self._wake_r.recv_bytes()
                elif ready in conns:
                    self._read(conns[ready])
                elif ready in sentinels:
                    self._reap(sentinels[ready])
            self._check_deadlines(time.monotonic())

    def _handle_requests(self) -> None:
        with self._lock:
            spawns, self._spawn_requests = self._spawn_requests, []
            kills, self._kill_requests = self._kill_requests, []
        for index in spawns:
            self._spawn(index)
        for index, cause in kills:
            self._signal(index, Event.KILL, cause)

    def _spawn(self, index: int) -> None:
        slot = self._slots[index]
        ctx = multiprocessing.get_context("spawn")
        config = {**slot.spec.config, "parent_pid": os.getpid(), "parent_death_signal": self._parent_death_signal}
        parent_conn = child_conn = None
        try:
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=slot.spec.target, args=(child_conn, config), name=slot.spec.name,
                               daemon=slot.spec.daemon)
            proc.start()
        except BaseException as exc:
            for conn in (parent_conn, child_conn):
                if conn is not None:
                    conn.close()
            with self._changed:
                self._spawn_error = (index, exc)
                slot.spawn_due = False
                self._changed.notify_all()
            return
        child_conn.close()
        with self._changed:
            slot.life = ChildProcessMachine()
            slot.proc, slot.conn, slot.conn_open, slot.pid = proc, parent_conn, True, proc.pid
            slot.exitcode, slot.hello, slot.heard_at = None, False, time.monotonic()
            slot.pipe_closed_at = slot.stop_at = slot.kill_cause = None
            slot.spawn_due = False
            if self._stopping:  # a stop came while it was being spawned
                slot.life.apply(Event.STOP)
                slot.stop_at, slot.stop_timeout = time.monotonic(), 0.0
            self._changed.notify_all()

    def _read(self, index: int) -> None:
        slot = self._slots[index]
        try:
            data = slot.conn.recv_bytes()
        except (EOFError, OSError):
            with self._send_lock:
                slot.conn_open = False  # the child is exiting (its sentinel says how) or closed its end
            slot.pipe_closed_at = time.monotonic()
            return
        slot.heard_at = time.monotonic()
        if slot.hello:
            self._on_message(index, data)
            return
        try:
            self._check_hello(index, data)
        except BaseException as exc:
            with self._changed:
                self._refusal = (index, exc)
                self._changed.notify_all()
            return
        with self._changed:
            slot.hello = True
            if slot.life.can(Event.HELLO):
                slot.life.apply(Event.HELLO)
            self._changed.notify_all()

    def _reap(self, index: int) -> None:
        slot = self._slots[index]
        while slot.conn_open and slot.conn.poll():  # what it sent just before it exited
            self._read(index)
        slot.proc.join()  # its sentinel fired: this does not block
        with self._send_lock:
            slot.conn_open = False
            slot.conn.close()
        exitcode = slot.proc.exitcode
        slot.proc.close()
        with self._changed:
            slot.exitcode = exitcode
            slot.life.apply(Event.EXIT)
            record = ChildExit(index, slot.pid, exitcode, expected=slot.stop_at is not None, cause=slot.kill_cause)
            self._changed.notify_all()
        try:
            self._on_exit(record)
        except Exception:
            log.exception("%s: on_exit raised for child %s", self.name, index)

    def _check_deadlines(self, now: float) -> None:
        for index, slot in enumerate(self._slots):
            if slot.life.state not in LIVE:
                continue
            if slot.stop_at is not None:
                due = due_signal(slot.life.state, since_stop=now - slot.stop_at, stop_timeout=slot.stop_timeout,
                                 kill_grace=self.kill_grace)
                if due is not None:
                    self._signal(index, due, None)
            elif slot.pipe_closed_at is not None and now - slot.pipe_closed_at > PIPE_CLOSED_GRACE:
                self._signal(index, Event.KILL, "it closed its pipe but did not exit")
            elif (
                self.heartbeat_timeout is not None and slot.life.state in HEARTBEAT_WATCHED
                and now - slot.heard_at > self.heartbeat_timeout
            ):
                self._signal(index, Event.KILL, f"it sent nothing within its heartbeat deadline of {self.heartbeat_timeout:g}s")

    def _signal(self, index: int, event: Event, cause: str | None) -> None:
        slot = self._slots[index]
        with self._lock:
            if not slot.life.can(event):
                return
            slot.life.apply(event)
            if cause is not None and slot.kill_cause is None:
                slot.kill_cause = cause
        if event is Event.TERMINATE:
            slot.proc.terminate()
        else:
            slot.proc.kill()

    def _abandon(self, cause: str) -> None:
        """The monitor crashed: kill and reap what is left so that nothing outlives it."""
        for index, slot in enumerate(self._slots):
            if slot.life.state not in LIVE or slot.proc is None:
                continue
            slot.kill_cause = slot.kill_cause or cause
            try:
                slot.proc.kill()
                slot.proc.join(self.kill_grace + 5)
            except Exception:  # pragma: no cover - best effort after a crash
                pass
            with self._changed:
                if slot.life.can(Event.EXIT):
                    slot.life.apply(Event.EXIT)
                slot.exitcode = slot.proc.exitcode
                self._changed.notify_all()
            with self._send_lock:
                slot.conn_open = False
                slot.conn.close()
            try:
                self._on_exit(ChildExit(index, slot.pid, slot.exitcode, expected=slot.stop_at is not None, cause=cause))
            except Exception:
                log.exception("%s: on_exit raised for child %s", self.name, index)

"""The supervisor's monitor thread: the one place children are spawned, read, signalled and reaped.

A :class:`engine.supervisor.Supervisor` answers its owner's calls (start and
wait for hellos, send, stop, kill, close) by changing the shared record here
under :attr:`ChildMonitor.lock` and waking the monitor; only the monitor thread
creates processes, reads their pipes, sends them signals and reaps them. It
spawns from this thread because Linux's parent-death signal fires when the
*spawning thread* ends, so that thread must outlive its children.

Each pass of the loop: take the queued spawn and kill requests, wait on the
wake pipe, every open pipe and every live child's sentinel (at most
:data:`MONITOR_POLL` seconds), then check each child's deadlines: the stop
escalation (the table in :mod:`states.child_process`), a pipe closed without
an exit, a missed heartbeat. The loop ends once a stop was asked for and every
child has been reaped.
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

from .pipe_reader import MessageReader, PipeClosed
from .supervised_child import end_process_group, stop_signals_held_for_the_child

__all__ = ["ChildExit", "ChildMonitor", "ChildSlot", "ChildSpec", "MONITOR_POLL", "PIPE_CLOSED_GRACE"]

log = logging.getLogger("chunkline.supervisor")

MONITOR_POLL = 0.1  # seconds between the monitor's checks of its deadlines
PIPE_CLOSED_GRACE = 1.0  # seconds a child that closed its pipe gets to exit before it is killed
REAPED_ELSEWHERE_WAIT = 1.0  # seconds another thread that reaped a child has to record its exit code


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


class ChildSlot:
    """The record of one child slot, shared by the owner's calls and the monitor thread.

    The owner's calls read and change it under :attr:`ChildMonitor.lock` (``conn`` and
    ``conn_open`` under the slot's own ``send_lock``: a write blocked on one child's full pipe
    holds up no other child's pipe, nor the monitor's reaping of another child); the monitor thread, which alone
    touches the process and its pipe, takes the lock for every change a waiter may need to see.
    """

    __slots__ = ("conn", "conn_open", "reader", "heard_at", "hello", "life", "pid", "pipe_closed_at", "proc", "spec",
                 "spawn_due", "stop_at", "stop_timeout", "kill_cause", "exitcode", "send_lock", "send_due",
                 "send_timeout")

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.life = ChildProcessMachine(State.EXITED)  # before its first spawn a slot reads as an exited child
        self.spawn_due = False  # a spawn was asked for and has not happened (or failed) yet
        self.proc: Any = None
        self.conn: Any = None
        self.conn_open = False
        self.reader: MessageReader | None = None  # the monitor's only way to read ``conn``: it never waits there
        self.send_lock = threading.Lock()
        self.send_due: float | None = None  # when a write still blocked then kills the child (set by its sender)
        self.send_timeout = 0.0
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.hello = False
        self.heard_at = 0.0
        self.pipe_closed_at: float | None = None
        self.stop_at: float | None = None
        self.stop_timeout = 0.0
        self.kill_cause: str | None = None


class ChildMonitor:
    """The monitor thread of one supervisor and the record it shares with the owner's calls.

    The public attributes are that shared record: change them only under ``lock``
    (``changed`` is its condition; notify it after a change a waiter may need).
    """

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        on_message: Callable[[int, bytes], None],
        on_exit: Callable[[ChildExit], None],
        kill_grace: float,
        heartbeat_timeout: float | None,
        parent_death_signal: bool,
        name: str,
    ) -> None:
        self.name = name
        self.kill_grace = kill_grace
        self.heartbeat_timeout = heartbeat_timeout
        self.slots = [ChildSlot(spec) for spec in children]
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.spawn_requests: list[int] = []
        self.kill_requests: list[tuple[int, str | None]] = []
        self.check_hello: Callable[[int, bytes], None] = lambda index, data: None
        self.refusal: tuple[int, BaseException] | None = None  # (index, what check_hello raised)
        self.spawn_error: tuple[int, BaseException] | None = None  # (index, why its process was not created)
        self.stopping = False
        self.finished = threading.Event()  # the loop has ended: every child reaped, every pipe closed
        self._on_message = on_message
        self._on_exit = on_exit
        self._parent_death_signal = parent_death_signal
        self._thread: threading.Thread | None = None
        self._wake_r: Any = None
        self._wake_w: Any = None

    # -- the owner's side ---------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, check_hello: Callable[[int, bytes], None] | None) -> None:
        """Start the thread with a spawn request for every slot (once)."""
        with self.lock:
            if self._thread is not None:
                raise RuntimeError(f"{self.name}: a supervisor starts once")
            if check_hello is not None:
                self.check_hello = check_hello
            self._wake_r, self._wake_w = multiprocessing.get_context("spawn").Pipe(duplex=False)
            self.spawn_requests = list(range(len(self.slots)))
            for slot in self.slots:
                slot.spawn_due = True
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-monitor", daemon=True)
        self._thread.start()

    def is_current(self) -> bool:
        """Whether the caller is the monitor thread."""
        return threading.current_thread() is self._thread

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def request_kill(self, index: int, cause: str | None) -> None:
        with self.lock:
            self.kill_requests.append((index, cause))
        self.wake()

    def wake(self) -> None:
        """Make the loop look at its requests and deadlines now."""
        if self._wake_w is None:
            return
        try:
            self._wake_w.send_bytes(b"x")
        except OSError:
            pass

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException as exc:  # a bug here must not leave children unwatched
            log.exception("%s: the monitor thread crashed", self.name)
            self._abandon(f"the supervisor's monitor thread crashed: {exc!r}")
        finally:
            with self.changed:
                self.changed.notify_all()
            if self._wake_r is not None:
                self._wake_r.close()
                self._wake_w.close()
            self.finished.set()

    def _watch(self) -> None:
        while True:
            self._handle_requests()
            with self.lock:
                slots = list(enumerate(self.slots))
                if self.stopping and all(slot.life.state not in LIVE for _, slot in slots) and not self.spawn_requests:
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
        with self.lock:
            spawns, self.spawn_requests = self.spawn_requests, []
            kills, self.kill_requests = self.kill_requests, []
        for index in spawns:
            self._spawn(index)
        for index, cause in kills:
            self._signal(index, Event.KILL, cause)

    def _spawn(self, index: int) -> None:
        slot = self.slots[index]
        ctx = multiprocessing.get_context("spawn")
        config = {**slot.spec.config, "parent_pid": os.getpid(), "parent_death_signal": self._parent_death_signal}
        parent_conn = child_conn = None
        try:
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=slot.spec.target, args=(child_conn, config), name=slot.spec.name,
                               daemon=slot.spec.daemon)
            with stop_signals_held_for_the_child():
                proc.start()
        except BaseException as exc:
            for conn in (parent_conn, child_conn):
                if conn is not None:
                    conn.close()
            with self.changed:
                self.spawn_error = (index, exc)
                slot.spawn_due = False
                self.changed.notify_all()
            return
        child_conn.close()
        with self.changed:
            slot.life = ChildProcessMachine()
            slot.proc, slot.conn, slot.conn_open, slot.pid = proc, parent_conn, True, proc.pid
            slot.reader = MessageReader(parent_conn.fileno())
            slot.exitcode, slot.hello, slot.heard_at = None, False, time.monotonic()
            slot.pipe_closed_at = slot.stop_at = slot.kill_cause = None
            slot.spawn_due = False
            if self.stopping:  # a stop came while it was being spawned
                slot.life.apply(Event.STOP)
                slot.stop_at, slot.stop_timeout = time.monotonic(), 0.0
            self.changed.notify_all()

    def _read(self, index: int) -> None:
        """Take what the child's readable pipe holds; handle each message it completes (never waits for the rest
        of a message: a child stopped half-way through writing one must not hold up its own deadlines)."""
        slot = self.slots[index]
        try:
            messages = slot.reader.read_ready()
        except PipeClosed as closed:
            with slot.send_lock:
                slot.conn_open = False  # the child is exiting (its sentinel says how) or closed its end
            slot.pipe_closed_at = time.monotonic()
            if closed.garbled:  # it still runs, writing what is no message: it is killed now, saying so
                self._signal(index, Event.KILL, f"its pipe carried no messages: {closed}")
            return
        slot.heard_at = time.monotonic()
        for data in messages:
            self._received(index, slot, data)

    def _received(self, index: int, slot: ChildSlot, data: bytes) -> None:
        if slot.hello:
            self._on_message(index, data)
            return
        try:
            self.check_hello(index, data)
        except BaseException as exc:
            with self.changed:
                self.refusal = (index, exc)
                self.changed.notify_all()
            return
        with self.changed:
            slot.hello = True
            if slot.life.can(Event.HELLO):
                slot.life.apply(Event.HELLO)
            self.changed.notify_all()

    def _reap(self, index: int) -> None:
        slot = self.slots[index]
        while slot.conn_open and slot.conn.poll():  # what it sent just before it exited
            self._read(index)
        end_process_group(slot.pid)  # what it started dies with it (before the join: its group id stays its own)
        slot.proc.join()  # its sentinel fired: this does not block
        with slot.send_lock:
            slot.conn_open = False
            slot.conn.close()
        exitcode = _exit_code_once_recorded(slot.proc)
        if exitcode is not None:
            slot.proc.close()
        with self.changed:
            slot.exitcode = exitcode
            slot.life.apply(Event.EXIT)
            record = ChildExit(index, slot.pid, exitcode, expected=slot.stop_at is not None, cause=slot.kill_cause)
            self.changed.notify_all()
        self._report_exit(record)

    def _check_deadlines(self, now: float) -> None:
        for index, slot in enumerate(self.slots):
            if slot.life.state not in LIVE:
                continue
            if slot.stop_at is not None:
                due = due_signal(slot.life.state, since_stop=now - slot.stop_at, stop_timeout=slot.stop_timeout,
                                 kill_grace=self.kill_grace)
                if due is not None:
                    self._signal(index, due, None)
            elif slot.pipe_closed_at is not None and now - slot.pipe_closed_at > PIPE_CLOSED_GRACE:
                self._signal(index, Event.KILL, "it closed its pipe but did not exit")
            elif (send_due := slot.send_due) is not None and now > send_due:
                self._signal(index, Event.KILL, f"it read none of a message sent to it for {slot.send_timeout:g}s "
                                                "(stopped or stuck: its pipe stayed full)")
            elif (
                self.heartbeat_timeout is not None and slot.life.state in HEARTBEAT_WATCHED
                and now - slot.heard_at > self.heartbeat_timeout
            ):
                self._signal(index, Event.KILL, f"it sent nothing within its heartbeat deadline of {self.heartbeat_timeout:g}s")

    def _signal(self, index: int, event: Event, cause: str | None) -> None:
        slot = self.slots[index]
        with self.lock:
            if not slot.life.can(event):
                return
            slot.life.apply(event)
            if cause is not None and slot.kill_cause is None:
                slot.kill_cause = cause
        if event is Event.TERMINATE:
            slot.proc.terminate()
        elif not end_process_group(slot.pid):  # the child with what it started, at once
            slot.proc.kill()  # it has no group of its own yet

    def _abandon(self, cause: str) -> None:
        """The loop crashed: kill and reap what is left so that nothing outlives it."""
        for index, slot in enumerate(self.slots):
            if slot.life.state not in LIVE or slot.proc is None:
                continue
            slot.kill_cause = slot.kill_cause or cause
            try:
                if not end_process_group(slot.pid):
                    slot.proc.kill()
                slot.proc.join(self.kill_grace + 5)
            except Exception:  # pragma: no cover - best effort after a crash
                pass
            with self.changed:
                if slot.life.can(Event.EXIT):
                    slot.life.apply(Event.EXIT)
                slot.exitcode = slot.proc.exitcode
                self.changed.notify_all()
            with slot.send_lock:
                slot.conn_open = False
                slot.conn.close()
            self._report_exit(ChildExit(index, slot.pid, slot.exitcode, expected=slot.stop_at is not None, cause=cause))

    def _report_exit(self, record: ChildExit) -> None:
        try:
            self._on_exit(record)
        except Exception:
            log.exception("%s: on_exit raised for child %s", self.name, record.index)


def _exit_code_once_recorded(proc: Any) -> int | None:
    """The exit code of a child whose sentinel fired.

    Every ``Process.start`` and ``active_children`` in this process polls all its children (multiprocessing's
    ``_cleanup``), on whatever thread calls it: one that reaps this child between its exit and ``join`` here leaves
    ``join`` an ECHILD, and it returns with no code, which that thread records a moment later (``close`` raised
    "Cannot close a process while it is still running" meanwhile, once, under a group Ctrl-C). None if it never
    comes: the child is gone all the same.
    """
    deadline = time.monotonic() + REAPED_ELSEWHERE_WAIT
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.001)  # bench-cost: only when another thread reaped the child first, for its recording
    return proc.exitcode


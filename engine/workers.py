"""Worker groups whose ranks are processes: :class:`ProcessWorkerGroup`.

Same interface as :class:`engine.parallel_actor.InProcessWorkerGroup`, so a
:class:`engine.parallel_actor.ParallelWorkerStageActor` owns either. Each rank is one
``multiprocessing`` *spawn* child built in the child by
``factory(rank=..., world_size=..., device=...)``; ``factory`` is a
``"module:callable"`` string or a picklable top-level callable.

    group = ProcessWorkerGroup("my.models:DiTRank", world_size=2, device_ids=("cuda:0", "cuda:1"))
    group.start(timeout=600)          # blocks until every rank is ready (run it in a thread under trio)
    latent = group.call("denoise", chunk)()   # rank 0's value
    group.close()

``start`` is separate from the constructor, so building a group never blocks
or spawns. One thread per group, the *monitor*, spawns the ranks (Linux's
parent-death signal fires when the spawning *thread* ends, so it must outlive
them), reads every reply, and waits on the ranks' sentinels: a rank that dies
fails the group within milliseconds. A failed group fails every pending and
later call with :class:`WorkerGroupFailed`; an exception inside a rank's method
is a :class:`WorkerCallError` for that call only. ``device_ids`` are labels
handed to the ranks; no resource group is ever inferred from them.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait as wait_ready
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .errors import EngineError, FatalStageError
from .worker_child import child_main

__all__ = [
    "ProcessWorkerGroup",
    "WorkerGroupError",
    "WorkerStartupError",
    "WorkerGroupFailed",
    "WorkerGroupClosed",
    "WorkerCallError",
    "DeferredResult",
]

log = logging.getLogger(__name__)
_ids = itertools.count(1)


class WorkerGroupError(EngineError, RuntimeError):
    """Base of the process worker group's errors."""


class WorkerStartupError(WorkerGroupError):
    """A rank could not start (import error, factory raised, exited, timed out); no rank is left running."""


class WorkerGroupFailed(WorkerGroupError, FatalStageError):
    """The group itself is broken (a rank died, a call timed out): every pending and later call fails.

    It is a :class:`FatalStageError`, so the stage actor owning the group fails with it.
    """


class WorkerGroupClosed(WorkerGroupError):
    """The group is closing or closed."""


class WorkerCallError(WorkerGroupError):
    """A rank's method raised; only this call fails. ``remote_traceback`` is the child's traceback text."""

    def __init__(self, message: str, *, rank: int, method: str, remote_type: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.method = method
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class _Call:
    __slots__ = ("call_id", "method", "ranks", "results", "error", "event")

    def __init__(self, call_id: int, method: str, ranks: tuple[int, ...]) -> None:
        self.call_id = call_id
        self.method = method
        self.ranks = ranks
        self.results: dict[int, tuple[bool, Any]] = {}
        self.error: BaseException | None = None
        self.event = threading.Event()


class DeferredResult:
    """What :meth:`ProcessWorkerGroup.call` returns: call it to wait for the value."""

    def __init__(self, group: ProcessWorkerGroup, call: _Call, gather: bool) -> None:
        self._group = group
        self._call = call
        self._gather = gather

    def done(self) -> bool:
        return self._call.event.is_set()

    def __call__(self, timeout: float | None = None) -> Any:
        """Rank 0's value (every rank's, in rank order, for gathered methods).

        Waits up to ``timeout`` (default: the group's ``call_timeout``; None waits
        for ever), always woken early by a group failure. A timeout fails the group.
        """
        call = self._call
        timeout = self._group.call_timeout if timeout is None else timeout
        if not call.event.wait(timeout):
            missing = sorted(set(call.ranks) - set(call.results))
            self._group._fail(f"call {call.method!r} (#{call.call_id}) got no answer from ranks {missing} within {timeout}s")
            call.event.wait()  # set by the failure
        if call.error is not None:
            raise call.error
        for rank in call.ranks:
            ok, payload = call.results[rank]
            if not ok:
                kind, message, tb = payload
                raise WorkerCallError(
                    f"rank {rank}: {call.method}() raised {kind}: {message}\n--- child traceback ---\n{tb}",
                    rank=rank, method=call.method, remote_type=kind, remote_traceback=tb,
                )
        values = [call.results[rank][1] for rank in call.ranks]
        return values if self._gather else values[0]


class ProcessWorkerGroup:
    """``world_size`` rank processes with the worker-group interface (see the module docs).

    ``gather``: methods whose deferred result is every rank's value; ``rank0_only``:
    methods sent to rank 0 alone. Timeouts in seconds: ``call_timeout`` (None: wait,
    but a failure always interrupts), ``close_timeout`` (graceful shutdown, after
    which ranks are terminated, then killed, ``kill_grace`` apart). The ranks are
    daemonic processes, so they cannot spawn multiprocessing children of their own.
    """

    def __init__(
        self,
        factory: str | Callable[..., Any],
        *,
        world_size: int = 1,
        device_ids: Iterable[str] | None = None,
        gather: Iterable[str] = (),
        rank0_only: Iterable[str] = (),
        call_timeout: float | None = None,
        close_timeout: float = 10.0,
        kill_grace: float = 2.0,
        name: str = "workers",
        parent_death_signal: bool = True,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if isinstance(factory, str) and factory.count(":") != 1:
            raise ValueError(f"factory must be 'module:callable', got {factory!r}")
        if not isinstance(factory, str) and not callable(factory):
            raise TypeError(f"factory must be a 'module:callable' string or a callable, got {factory!r}")
        self.device_ids = ("cpu",) * world_size if device_ids is None else tuple(device_ids)
        if len(self.device_ids) != world_size:
            raise ValueError(f"need one device id per rank: {world_size} ranks, device_ids={self.device_ids}")
        self.world_size = world_size
        self.factory = factory
        self.name = name
        self.call_timeout = call_timeout
        self.close_timeout = close_timeout
        self.kill_grace = kill_grace
        self._gather = frozenset(gather)
        self._rank0_only = frozenset(rank0_only)
        self._parent_death_signal = parent_death_signal
        self.failed = False
        self.failure_reason: str | None = None
        self.closed = False
        self.exit_codes: dict[int, int | None] = {}
        self.close_errors: dict[int, str] = {}  # rank -> traceback of its close() failing
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._exits = threading.Condition(self._lock)
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        self._procs: list[Any] = []
        self._pids: list[int] = []
        self._conns: list[Any] = []
        self._monitor: threading.Thread | None = None
        self._started = threading.Event()
        self._startup_error: WorkerStartupError | None = None
        self._closing = False
        self._stop = False
        self._wake_r: Any = None  # a pipe that wakes the monitor (made by start)
        self._wake_w: Any = None
        self._closed_event = threading.Event()

    # -- properties -----------------------------------------------------------------

    @property
    def pids(self) -> tuple[int, ...]:
        """Each rank's process id (after start)."""
        return tuple(self._pids)

    @property
    def started(self) -> bool:
        return self._started.is_set() and self._startup_error is None

    # -- start ------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> ProcessWorkerGroup:
        """Spawn every rank and wait until each has built its rank object.

        Raises :class:`WorkerStartupError` (with the child's traceback when it has
        one) after killing and joining every rank; the group is then closed.
        """
        with self._lock:
            if self._closing:
                raise WorkerGroupClosed(f"{self.name} is closed")
            if self._monitor is not None:
                raise RuntimeError("a worker group starts once")
            self._wake_r, self._wake_w = multiprocessing.get_context("spawn").Pipe(duplex=False)
            self._monitor = threading.Thread(target=self._run, args=(timeout,), name=f"{self.name}-monitor", daemon=True)
        self._monitor.start()
        self._started.wait()
        if self._startup_error is not None:
            self._monitor.join()
            self._release()
            self.closed = True
            self._closed_event.set()
            raise self._startup_error
        return self

    def __enter__(self) -> ProcessWorkerGroup:
        return self.start() if self._monitor is None else self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _run(self, timeout: float) -> None:
        try:
            self._spawn()
            self._await_ready(time.monotonic() + timeout)
        except BaseException as exc:
            if not isinstance(exc, WorkerStartupError):
                exc = WorkerStartupError(f"{self.name}: could not start the ranks: {exc!r}")
            self._startup_error = exc
            for proc in self._procs:
                proc.kill()
            for proc in self._procs:
                proc.join(self.kill_grace + 5)
            self._closing = True
            self._started.set()
            return
        self._started.set()
        try:
            self._serve()
        except BaseException as exc:  # a bug here must not leave deaths unnoticed
            self._fail(f"the monitor thread crashed: {exc!r}")
            raise

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            self._conns.append(parent_conn)
            config = {
                "factory": self.factory, "rank": rank, "world_size": self.world_size,
                "device": self.device_ids[rank], "parent_pid": os.getpid(),
                "parent_death_signal": self._parent_death_signal,
            }
            proc = ctx.Process(target=child_main, args=(child_conn, config), name=f"{self.name}-rank{rank}", daemon=True)
            try:
                proc.start()
            finally:
                child_conn.close()
            self._procs.append(proc)
            self._pids.append(proc.pid)

    def _await_ready(self, deadline: float) -> None:
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerStartupError(f"{self.name}: ranks {sorted(waiting.values())} not ready in time")
            for obj in wait_ready([*waiting, *sentinels], remaining):
                rank = waiting[obj] if obj in waiting else sentinels[obj]
                conn, proc = self._conns[rank], self._procs[rank]
                message = None
                if conn in waiting and conn.poll():
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        pass
                if message is not None and message[0] == "ready":
                    del waiting[conn]
                    continue
                if message is not None and message[0] == "startup_failed":
                    raise WorkerStartupError(
                        f"{self.name}: rank {rank} failed to start:\n--- child traceback ---\n{message[2]}"
                    )
                proc.join(self.kill_grace)
                raise WorkerStartupError(
                    f"{self.name}: rank {rank} (pid {proc.pid}) exited during startup with code {proc.exitcode}"
                )

    # -- serving ------------------------------------------------------------------------

    def _serve(self) -> None:
        conns = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while not self._stop:
            for obj in wait_ready([self._wake_r, *conns, *sentinels], 0.5):
                if obj is self._wake_r:
                    self._wake_r.recv_bytes()
                elif obj in conns:
                    self._read(obj, conns)
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self._conns[rank]
                    while conn in conns and conn.poll():  # replies sent just before it exited
                        self._read(conn, conns)
                    conns.pop(conn, None)
                    self._reap(rank)

    def _read(self, conn: Any, conns: dict[Any, int]) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            conns.pop(conn, None)  # the rank is exiting; its sentinel reports how
            return
        if message[0] == "result":
            _, call_id, rank, ok, payload = message
            with self._lock:
                call = self._pending.get(call_id)
                if call is None:
                    return
                call.results[rank] = (ok, payload)
                if len(call.results) == len(call.ranks):
                    del self._pending[call_id]
                    call.event.set()
        elif message[0] == "closed" and message[2] is not None:
            self.close_errors[message[1]] = message[2]

    def _reap(self, rank: int) -> None:
        proc = self._procs[rank]
        proc.join(self.kill_grace)
        code = proc.exitcode
        with self._exits:
            self.exit_codes[rank] = code
            self._exits.notify_all()
            closing = self._closing
        if not closing:
            self._fail(f"rank {rank} (pid {proc.pid}) exited unexpectedly with code {code}")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failed or self.closed:
                return
            self.failed = True
            self.failure_reason = reason
            pending, self._pending = list(self._pending.values()), {}
            callbacks = list(self._callbacks)
        self._abort(pending, WorkerGroupFailed(f"{self.name} failed: {reason}"))
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("%s: a failure callback raised", self.name)

    @staticmethod
    def _abort(calls: list[_Call], error: BaseException) -> None:
        for call in calls:
            call.error = error
            call.event.set()

    # -- the worker-group interface ---------------------------------------------------------

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` runs once, in any thread, when the group fails (at once if it has)."""
        with self._lock:
            if not self.failed:
                self._callbacks.append(callback)
                return
            reason = self.failure_reason
        callback(reason or "worker group failed")

    def call(self, method: str, *args: Any, **kwargs: Any) -> DeferredResult:
        """Send ``method(*args, **kwargs)`` to every rank (rank 0 alone for ``rank0_only``)."""
        ranks = (0,) if method in self._rank0_only else tuple(range(self.world_size))
        call = _Call(next(_ids), method, ranks)
        payload = ForkingPickler.dumps(("call", call.call_id, method, args, kwargs))
        with self._lock:
            if self.failed:
                raise WorkerGroupFailed(f"{self.name} failed: {self.failure_reason}")
            if self._closing:
                raise WorkerGroupClosed(f"{self.name} is closed")
            if not self._started.is_set():
                raise RuntimeError(f"{self.name} is not started; call start() first")
            self._pending[call.call_id] = call
        with self._send_lock:
            for rank in ranks:
                try:
                    self._conns[rank].send_bytes(payload)
                except OSError:
                    break  # the rank is gone: the monitor fails the group, and this call with it
        return DeferredResult(self, call, method in self._gather)

    def close(self, timeout: float | None = None) -> None:
        """Shut every rank down and release everything; bounded and idempotent.

        Ranks get a shutdown message (each runs its rank object's ``close()``) and
        ``timeout`` seconds (default ``close_timeout``; at most ``kill_grace`` once the
        group has failed) to exit; then SIGTERM, then SIGKILL, ``kill_grace`` apart.
        Returns once every rank is joined and every pipe closed: within about
        ``timeout + 3 * kill_grace``. Pending calls fail with :class:`WorkerGroupClosed`.
        """
        if threading.current_thread() is self._monitor:
            raise RuntimeError("close() cannot run on the group's monitor thread (e.g. from a failure callback)")
        with self._lock:
            already, self._closing = self._closing, True
            pending, self._pending = list(self._pending.values()), {}
        if already:  # closed, closing in another thread, or a failed start (which closes)
            self._closed_event.wait()
            return
        if self._monitor is not None:
            self._started.wait()
            timeout = self.close_timeout if timeout is None else timeout
            if self.failed:  # survivors may be stuck waiting on the dead rank: do not wait long
                timeout = min(timeout, self.kill_grace)
            threading.Thread(target=self._send_shutdown, name=f"{self.name}-shutdown", daemon=True).start()
            if not self._wait_exits(timeout):
                for proc in self._procs:
                    proc.terminate()  # harmless on a process that has already exited
                if not self._wait_exits(self.kill_grace):
                    for proc in self._procs:
                        proc.kill()
                    self._wait_exits(self.kill_grace)
            self._stop = True
            self._wake()
            self._monitor.join()
        self._abort(pending, WorkerGroupClosed(f"{self.name} closed while the call was pending"))
        with self._lock:
            self.closed = True
        self._release()
        self._closed_event.set()

    def _send_shutdown(self) -> None:
        if not self._send_lock.acquire(timeout=self.close_timeout):
            return  # a send is stuck; terminate and kill come next
        try:
            for conn in self._conns:
                try:
                    conn.send(("shutdown",))
                except OSError:
                    pass
        finally:
            self._send_lock.release()

    def _wait_exits(self, timeout: float) -> bool:
        with self._exits:
            return self._exits.wait_for(lambda: len(self.exit_codes) == self.world_size, timeout)

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"x")
        except OSError:
            pass

    def _release(self) -> None:
        """Join and close every process and pipe (once the monitor has stopped)."""
        with self._send_lock:
            for proc in self._procs:
                if proc.exitcode is None:  # only if the monitor could not reap it
                    proc.kill()
                    proc.join()
                proc.close()
            for conn in self._conns:
                conn.close()
            if self._wake_r is not None:
                self._wake_r.close()
                self._wake_w.close()

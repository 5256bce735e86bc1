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
or spawns. The ranks are children of one :class:`engine.supervisor.Supervisor`
(spawned from its monitor thread, bound to this process's life, stopped
politely, then with SIGKILL, and reaped: a rank ignores SIGTERM, SIGINT and SIGHUP, which a stop signal to the
whole process group brings it, so the supervisor's SIGTERM only starts ``kill_grace``), which hands every reply
to the group and tells it of every exit: a rank that dies fails the group
within milliseconds. The group's lifecycle is the table in
:mod:`states.process_group`. A failed group fails every pending and
later call with :class:`WorkerGroupFailed`; an exception inside a rank's method
is a :class:`WorkerCallError` for that call only. ``device_ids`` are labels
handed to the ranks; no resource group is ever inferred from them.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from states.process_group import TAKES_CALLS, TERMINAL, Event, ProcessGroupMachine, on_rank_exit

from .deferred_result import DeferredResult, PendingCall, release_values
from .errors import error_text, integer, seconds, shown
from .supervisor import ChildExit, ChildSpec, StartupFailed, StartupProblem, Supervisor
from .worker_child import child_main
from .worker_errors import (
    WorkerCallError, WorkerFatalCallError, WorkerGroupClosed, WorkerGroupError, WorkerGroupFailed, WorkerStartupError,
)
from .worker_wire import (
    Call, Closed, Fetched, Raised, RankReady, RankStartFailed, Result, Shutdown, UnknownWorkerMessage, dump_arguments,
    release_shared,
)

__all__ = [
    "ProcessWorkerGroup",
    "WorkerGroupError",
    "WorkerStartupError",
    "WorkerGroupFailed",
    "WorkerGroupClosed",
    "WorkerCallError",
    "WorkerFatalCallError",
    "DeferredResult",
]

log = logging.getLogger(__name__)
_ids = itertools.count(1)


def method_names(name: str, value: object) -> frozenset[str]:
    """A worker group's set of method names (``gather``, ``rank0_only``): one name (a bare string is that name,
    not its characters) or an iterable of names, each a non-empty string; else a ValueError naming ``name``."""
    try:
        names = (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]
    except TypeError:  # not iterable (None, 5)
        raise ValueError(f"{name} must be a method name or an iterable of method names, got {shown(value)}") from None
    for item in names:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{name} must hold method names (non-empty strings), got {shown(item)} in {shown(value)}")
    return frozenset(names)


def device_labels(device_ids: object, world_size: int) -> tuple[Any, ...]:
    """A worker group's device label per rank: ``"cpu"`` for each when None, a bare string as one label (not its
    characters); else a ValueError naming ``device_ids`` (not iterable, or not one per rank)."""
    if device_ids is None:
        return ("cpu",) * world_size
    try:
        labels = (device_ids,) if isinstance(device_ids, str) else tuple(device_ids)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"device_ids must be an iterable of device labels, got {shown(device_ids)}") from None
    if len(labels) != world_size:
        raise ValueError(f"need one device id per rank: {world_size} ranks, device_ids={shown(labels)}")
    return labels


class ProcessWorkerGroup:
    """``world_size`` rank processes with the worker-group interface (see the module docs).

    ``gather``: methods whose deferred result is every rank's value; ``rank0_only``:
    methods sent to rank 0 alone (each a method name or an iterable of them). Timeouts in seconds: ``call_timeout`` (None: wait,
    but a failure always interrupts; it also bounds sending a call to a rank: one that
    reads none of it for that long is killed, which fails the group), ``close_timeout`` (graceful shutdown, after
    which ranks are killed, ``kill_grace`` later: they ignore the SIGTERM sent between). The ranks are
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
        world_size = integer("world_size", world_size, minimum=1)
        if call_timeout is not None:
            call_timeout = seconds("call_timeout", call_timeout, finite=True)
        close_timeout = seconds("close_timeout", close_timeout, zero_ok=True, finite=True)
        kill_grace = seconds("kill_grace", kill_grace, zero_ok=True, finite=True)
        gather, rank0_only = method_names("gather", gather), method_names("rank0_only", rank0_only)
        if isinstance(factory, str) and factory.count(":") != 1:
            raise ValueError(f"factory must be 'module:callable', got {factory!r}")
        if not isinstance(factory, str) and not callable(factory):
            raise TypeError(f"factory must be a 'module:callable' string or a callable, got {factory!r}")
        self.device_ids = device_labels(device_ids, world_size)
        self.world_size = world_size
        self.factory = factory
        self.name = name
        self.call_timeout = call_timeout
        self.close_timeout = close_timeout
        self.kill_grace = kill_grace
        self._gather = gather
        self._rank0_only = rank0_only
        self.failure_reason: str | None = None
        self.exit_codes: dict[int, int | None] = {}
        self.close_errors: dict[int, str] = {}  # rank -> traceback of its close() failing
        self._life = ProcessGroupMachine()
        self._ran = False  # start() succeeded once
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._pending: dict[int, PendingCall] = {}
        self._abandoned: deque[PendingCall] = deque()  # calls whose deferred results were dropped uncalled
        # (call id, rank) -> the shared-memory handles of that rank's arguments (a CPU tensor: one descriptor each),
        # which this process holds until the rank says it fetched them (Fetched) or answers
        self._held_for_ranks: dict[tuple[int, int], bytes] = {}
        self._supervisor = Supervisor(
            [
                ChildSpec(f"{name}-rank{rank}", child_main, {
                    "factory": factory, "rank": rank, "world_size": world_size, "device": self.device_ids[rank],
                })
                for rank in range(world_size)
            ],
            on_message=self._on_message, on_exit=self._on_exit, close_timeout=close_timeout,
            kill_grace=kill_grace, parent_death_signal=parent_death_signal, name=name,
        )
        self._closed_event = threading.Event()
        self._start_settled = threading.Event()  # clear only while start() runs
        self._starting_thread: int | None = None  # the thread start() runs on, while it runs
        self._start_settled.set()

    # -- properties -----------------------------------------------------------------

    @property
    def state(self) -> Any:
        """The group's lifecycle state (:mod:`states.process_group`)."""
        return self._life.state

    @property
    def pids(self) -> tuple[int, ...]:
        """Each spawned rank's process id (after start)."""
        return tuple(pid for pid in self._supervisor.pids if pid is not None)

    @property
    def started(self) -> bool:
        """``start()`` succeeded (the group may have failed or closed since)."""
        return self._ran

    @property
    def failed(self) -> bool:
        return self.failure_reason is not None

    @property
    def closed(self) -> bool:
        return self._life.state in TERMINAL

    @property
    def processes_released(self) -> bool:
        """Every rank reaped and every pipe closed."""
        return self._supervisor.finished

    # -- start ------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> ProcessWorkerGroup:
        """Spawn every rank and wait until each has built its rank object.

        Raises :class:`WorkerStartupError` (with the child's traceback when it has
        one) after killing and joining every rank; the group is then closed. Anything
        else that ends the wait early (a ``KeyboardInterrupt``, say) also kills and
        joins every rank and closes the group before it propagates.
        """
        timeout = seconds("timeout", timeout, finite=True)
        with self._lock:
            if not self._life.can(Event.START):
                if self._life.state in TERMINAL:
                    raise WorkerGroupClosed(f"{self.name} is closed")
                raise RuntimeError("a worker group starts once")
            self._life.apply(Event.START)
            self._start_settled.clear()
            self._starting_thread = threading.get_ident()
        ready = False
        try:
            self._supervisor.start(timeout, check_hello=self._check_hello)
            ready = True
        except StartupFailed as exc:
            raise self._startup_error(exc) from None
        finally:
            if not ready:  # a startup error, or the wait was interrupted: no rank may outlive the failed start
                self._supervisor.close(None, timeout=0.0)  # a no-op once StartupFailed has reaped them
            with self._lock:
                self._life.apply(Event.READY if ready else Event.START_FAILED)
                self._ran = ready
            if not ready:
                self._closed_event.set()
            self._starting_thread = None
            self._start_settled.set()
        return self

    def _check_hello(self, rank: int, data: bytes) -> None:
        match pickle.loads(data):
            case RankReady():
                pass
            case RankStartFailed(traceback=tb):
                raise WorkerStartupError(f"{self.name}: rank {rank} failed to start:\n--- child traceback ---\n{tb}")
            case other:
                raise WorkerStartupError(
                    f"{self.name}: {UnknownWorkerMessage(other, sender=f'rank {rank}', expected=(RankReady, RankStartFailed))}"
                )

    def _startup_error(self, failure: StartupFailed) -> WorkerStartupError:
        if failure.problem == StartupProblem.REFUSED and isinstance(failure.__cause__, WorkerStartupError):
            return failure.__cause__
        if failure.problem == StartupProblem.EXITED:
            return WorkerStartupError(
                f"{self.name}: rank {failure.index} (pid {failure.pid}) exited during startup with code {failure.exitcode}"
            )
        if failure.problem == StartupProblem.TIMED_OUT:
            return WorkerStartupError(f"{self.name}: ranks {list(failure.waiting)} not ready in time")
        return WorkerStartupError(f"{self.name}: could not start the ranks: {failure.__cause__!r}")

    def __enter__(self) -> ProcessWorkerGroup:
        return self.start() if self._life.can(Event.START) else self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- what the supervisor reports (its monitor thread) --------------------------------------

    def _on_message(self, rank: int, data: bytes) -> None:
        try:
            message = pickle.loads(data)
        except Exception as exc:  # ranks send only the wire's messages: anything else fails the group, naming it
            self._fail(f"rank {rank} sent a message that does not load ({error_text(exc)})")
            return
        match message:
            case Fetched(call_id=call_id, rank=fetched_by):
                with self._lock:
                    self._held_for_ranks.pop((call_id, fetched_by), None)
            case Result() | Raised():
                with self._lock:
                    self._held_for_ranks.pop((message.call_id, message.rank), None)  # it had them (or let them go)
                    call = self._pending.get(message.call_id)
                    if call is None:
                        return
                    call.results[message.rank] = message
                    if len(call.results) == len(call.ranks):
                        del self._pending[message.call_id]
                        call.event.set()
                        if call.abandoned:  # nobody will call for its values: the next call releases them
                            self._abandoned.append(call)
            case Closed(rank=closed_rank, error=error):
                if error is not None:
                    self.close_errors[closed_rank] = error
            case _:
                expected = (Fetched, Result, Raised, Closed)
                self._fail(str(UnknownWorkerMessage(message, sender=f"rank {rank}", expected=expected)))

    def _on_exit(self, exit: ChildExit) -> None:
        self.exit_codes[exit.index] = exit.exitcode
        if on_rank_exit(self._life.state, expected=exit.expected) is not None:
            cause = f" ({exit.cause})" if exit.cause else ""
            self._fail(f"rank {exit.index} (pid {exit.pid}) exited unexpectedly with code {exit.exitcode}{cause}")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if not self._life.can(Event.FAIL):  # starting (start() reports it), closing or closed
                return
            self._life.apply(Event.FAIL)
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
    def _abort(calls: list[PendingCall], error: BaseException) -> None:
        for call in calls:
            call.error = error
            call.event.set()

    def _release_held(self) -> None:
        """Once every rank is gone: the shared memory of arguments no rank said it fetched (its call was queued
        behind another, or it died first), which this process held for it. (A rank that died half-way through
        fetching leaves the resource sharer a handle already served: it reports that one and goes on.)"""
        with self._lock:
            held, self._held_for_ranks = self._held_for_ranks, {}
        for shared in held.values():
            release_shared(shared)

    # -- the worker-group interface ---------------------------------------------------------

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` runs once, in any thread, when the group fails (at once if it has)."""
        with self._lock:
            if self.failure_reason is None:
                self._callbacks.append(callback)
                return
            reason = self.failure_reason
        callback(reason)

    def call(self, method: str, *args: Any, **kwargs: Any) -> DeferredResult:
        """Send ``method(*args, **kwargs)`` to every rank (rank 0 alone for ``rank0_only``)."""
        ranks = (0,) if method in self._rank0_only else tuple(range(self.world_size))
        call = PendingCall(next(_ids), method, ranks)
        self._check_takes_calls()  # before pickling: a CPU tensor argument is shared while it is pickled
        self._release_abandoned()
        dumped: list[tuple[bytes, bytes]] = []
        try:
            try:
                # once per rank: a CPU tensor travels as a shared-memory handle that only one process can fetch
                for _ in ranks:
                    dumped.append(dump_arguments(args, kwargs))
                payloads = [ForkingPickler.dumps(Call(call.call_id, method, *arguments)) for arguments in dumped]
            except Exception as exc:
                raise TypeError(f"{self.name}: the arguments of {method}() cannot be sent to the ranks: "
                                f"{error_text(exc)}") from exc
            with self._lock:
                self._check_takes_calls()
                self._pending[call.call_id] = call
                self._held_for_ranks.update(
                    {(call.call_id, rank): shared for rank, (_, shared) in zip(ranks, dumped) if shared})
        except BaseException:
            for _, shared in dumped:  # what did pickle: no rank will ever fetch it
                release_shared(shared)
            raise
        for rank, payload in zip(ranks, payloads):
            if not self._supervisor.send(rank, payload, timeout=self.call_timeout):
                break  # the rank is gone: its exit fails the group, and this call with it
        return DeferredResult(call, method in self._gather, call_timeout=self.call_timeout, fail=self._fail,
                              abandoned=self._abandoned, group_closed=lambda: self.closed)

    def _release_abandoned(self) -> None:
        """The values of calls whose deferred results were dropped uncalled: released (their ranks held them), or,
        for a call still owed answers, marked so that its completion hands it back here."""
        done = []
        with self._lock:
            while self._abandoned:
                call = self._abandoned.popleft()
                if call.call_id in self._pending:
                    call.abandoned = True
                else:
                    done.append(call)
        for call in done:
            release_values(call)

    def _check_takes_calls(self) -> None:
        if self.failure_reason is not None:
            raise WorkerGroupFailed(f"{self.name} failed: {self.failure_reason}")
        if self._life.state not in TAKES_CALLS:
            if self._life.can(Event.START):
                raise RuntimeError(f"{self.name} is not started; call start() first")
            raise WorkerGroupClosed(f"{self.name} is closed")

    def close(self, timeout: float | None = None) -> None:
        """Shut every rank down and release everything; bounded and idempotent.

        Ranks get a shutdown message (each runs its rank object's ``close()``) and
        ``timeout`` seconds (default ``close_timeout``; at most ``kill_grace`` once the
        group has failed) to exit; then SIGTERM (which a rank ignores), then SIGKILL, ``kill_grace`` apart.
        Returns once every rank is joined and every pipe closed: within about
        ``timeout + 3 * kill_grace``. Pending calls fail with :class:`WorkerGroupClosed`.
        """
        if self._supervisor.on_monitor_thread():
            raise RuntimeError("close() cannot run on the group's monitor thread (e.g. from a failure callback)")
        if self._starting_thread == threading.get_ident():  # it would wait for ever for the start() it interrupted
            raise RuntimeError(f"{self.name}: close() ran inside start() on the same thread (a signal handler?); "
                               "raise there instead: the interrupted start() closes the group")
        self._start_settled.wait()  # a start in another thread ends first (bounded by its timeout)
        with self._lock:
            if self._life.can(Event.CLOSE):
                self._life.apply(Event.CLOSE)
        if self._closed_event.is_set():
            return
        # every close() does the work, each part bounded and idempotent: one interrupted half-way (Ctrl-C) or asked
        # again meanwhile (a signal handler on the closing thread) is finished by the next, not waited for for ever
        timeout = self.close_timeout if timeout is None else timeout
        if self.failure_reason is not None:  # survivors may be stuck waiting on the dead rank: do not wait long
            timeout = min(timeout, self.kill_grace)
        self._supervisor.close(ForkingPickler.dumps(Shutdown()), timeout=timeout)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        self._abort(pending, WorkerGroupClosed(f"{self.name} closed while the call was pending"))
        self._release_held()
        with self._lock:
            if self._life.can(Event.CLOSED):
                self._life.apply(Event.CLOSED)
        self._closed_event.set()

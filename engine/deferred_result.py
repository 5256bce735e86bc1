"""One worker-group call on its way back: :class:`PendingCall`, and :class:`DeferredResult`, what ``call()`` returns.

A rank's value holds the shared memory of its CPU tensors until this process fetches it, which the
deferred result does when called. One that is dropped uncalled appends its call to the group's deque of
abandoned calls, and the group releases those values at its next call: a rank does not hold them for its life.
(An append waits for nothing, so a collection that runs in any thread, at any point, even while the group holds
its own lock, is safe.)
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from .errors import seconds
from .tensor_channel_refs import discard_lost_transfers
from .worker_errors import WorkerCallError, WorkerFatalCallError, WorkerGroupClosed
from .worker_wire import Raised, Result, UnloadableValue, load_value, release_shared

__all__ = ["DeferredResult", "PendingCall", "release_values"]


class PendingCall:
    """What the group knows of one call: the ranks it went to, their answers so far, its error, its end."""

    __slots__ = ("call_id", "method", "ranks", "results", "error", "event", "abandoned")

    def __init__(self, call_id: int, method: str, ranks: tuple[int, ...]) -> None:
        self.call_id = call_id
        self.method = method
        self.ranks = ranks
        self.results: dict[int, Result | Raised] = {}
        self.error: BaseException | None = None
        self.event = threading.Event()
        self.abandoned = False  # its deferred result was dropped uncalled while answers were still due


def release_values(call: PendingCall, loaded: Iterable[int] = (), fetched: dict[int, set[int]] | None = None,
                   *, lost: bool = True) -> None:
    """The shared memory of every value of ``call`` not loaded here (ranks not in ``loaded``; of a value whose load
    failed, the handles not in ``fetched[rank]``): fetched and closed, or its rank would hold it for good. When the
    call's values are ``lost``, the tensor-channel transfers they name are discarded too: nobody here holds their
    refs any more, and their slots would stay taken until the producer's next send into them timed out."""
    loaded = set(loaded)
    for rank, result in call.results.items():
        if not isinstance(result, Result):
            continue
        if result.shared and rank not in loaded:
            release_shared(result.shared, (fetched or {}).get(rank, set()))
        if lost and result.transfers:
            discard_lost_transfers(result.transfers)


class DeferredResult:
    """What :meth:`ProcessWorkerGroup.call` returns: call it to wait for the value.

    Call it: the shared memory of CPU tensors in the ranks' values is fetched from the ranks then (a value that
    does not load, or one another rank's error leaves unloaded, has it fetched and closed), and held by them
    until then. Dropped uncalled, its call is handed to the group, which releases the values at its next call."""

    def __init__(self, call: PendingCall, gather: bool, *, call_timeout: float | None,
                 fail: Callable[[str], None], abandoned: deque[PendingCall],
                 group_closed: Callable[[], bool] = lambda: False) -> None:
        self._call = call
        self._group_closed = group_closed  # a value not fetched before its group closed went with the ranks
        self._gather = gather
        self._call_timeout = call_timeout
        self._fail = fail  # fails the group (a call that got no answer in time)
        self._loaded: dict[int, Any] = {}
        # one caller at a time loads: a shared-memory handle is served once, so two threads loading one value at once
        # each fetched some of its handles, and both failed (EOFError)
        self._loading = threading.Lock()
        self._fetched: dict[int, set[int]] = {}  # rank -> the places of the shared handles a failed load fetched
        # dropped uncalled, the call goes to ``abandoned``; detached (alive no more) once the values are released
        self._on_drop = weakref.finalize(self, abandoned.append, call)
        self._on_drop.atexit = False  # at exit the ranks end, and what they hold with them

    def done(self) -> bool:
        return self._call.event.is_set()

    def __call__(self, timeout: float | None = None) -> Any:
        """Rank 0's value (every rank's, in rank order, for gathered methods).

        Waits up to ``timeout`` (default: the group's ``call_timeout``; None waits
        for ever), always woken early by a group failure. A timeout fails the group.
        """
        call = self._call
        timeout = self._call_timeout if timeout is None else seconds("timeout", timeout, finite=True)
        if not call.event.wait(timeout):
            missing = sorted(set(call.ranks) - set(call.results))
            self._fail(f"call {call.method!r} (#{call.call_id}) got no answer from ranks {missing} within {timeout}s")
            call.event.wait()  # set by the failure
        if call.error is not None:
            raise call.error
        with self._loading:
            return self._values()

    def _values(self) -> Any:
        """Every rank's value, loaded (once: a second call returns the same), or the first rank's error."""
        call = self._call
        values = []
        lost = True  # until every value is loaded: a value this call does not return is lost here
        try:
            for rank in call.ranks:
                match call.results[rank]:
                    case Result(value=data):
                        values.append(self._load(rank, data))
                    case Raised(error=error):
                        raise (WorkerFatalCallError if error.fatal else WorkerCallError)(
                            f"rank {rank}: {call.method}() raised {error.type_name}: {error.message}\n"
                            f"--- child traceback ---\n{error.traceback}",
                            rank=rank, method=call.method, remote_type=error.type_name,
                            remote_traceback=error.traceback,
                        )
            lost = False
        finally:
            self._release_unloaded(lost)
        return values if self._gather else values[0]

    def _release_unloaded(self, lost: bool) -> None:
        """Release (:func:`release_values`) every value this call will not load: it did not, or another rank raised."""
        if self._on_drop.detach() is None:  # released already
            return
        release_values(self._call, self._loaded, self._fetched, lost=lost)

    def _load(self, rank: int, data: bytes) -> Any:
        """A rank's value, loaded once; one that does not load in this process fails this call (the group lives on)."""
        if rank not in self._loaded:
            method = self._call.method
            fetched = self._fetched.setdefault(rank, set())
            try:
                self._loaded[rank] = load_value(data, fetched)
            except UnloadableValue as exc:
                if self._group_closed():  # its shared memory went with the ranks: say so, not that it did not load
                    raise WorkerGroupClosed(
                        f"rank {rank}: the value {method}() returned was not fetched before its group closed, and "
                        f"what it held went with the ranks: call a deferred result before closing its group"
                    ) from None
                raise WorkerCallError(
                    f"rank {rank}: the value {method}() returned does not load in this process: {exc}",
                    rank=rank, method=method, remote_type="", remote_traceback="",
                ) from None
        return self._loaded[rank]

"""A dedicated OS thread that runs every synchronous call of one owner.

trio's thread pool may run consecutive calls on different threads; model code
is often thread-affine (CUDA's current device, cuDNN handles, many C
libraries), so each synchronous stage actor gets exactly one thread for its
whole life. The thread asks for the least timer slack (:mod:`engine.timer_slack`).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio

from .timer_slack import STAGE_TIMER_SLACK_NS, set_thread_timer_slack

__all__ = ["DedicatedThread", "NOTHING_LEFT", "ThreadStopped", "TrioInbox", "WaitQueue"]

_STOP = object()
# what a delivery's ``on_thread`` returns when it handled the result entirely: nothing to post to trio
NOTHING_LEFT = object()


class ThreadStopped(RuntimeError):
    """A call was handed to a dedicated thread that has been told to stop: it will never run there."""


class WaitQueue:
    """A trio wait queue whose waiters another thread can see before it decides to wake them.

    A waiter counts itself in under the owner's lock before it checks its condition, so a
    change made after that (on any thread, under the same lock) sees it and wakes it, and
    one made before is seen by the check: no wake-up is lost, and a thread that finds
    nobody waiting has nothing to hand to trio. Waiters park with trio's low-level
    primitives directly (a ``ParkingLot`` does the same, with more Python per wake-up).
    """

    __slots__ = ("_parked", "waiting")

    def __init__(self) -> None:
        self._parked: dict[trio.lowlevel.Task, None] = {}  # in trio only
        self.waiting = 0  # changed under the owner's lock only

    @trio.lowlevel.enable_ki_protection  # a KeyboardInterrupt must not leave a task listed that is not parked
    async def wait_until(self, lock: threading.Lock | threading.RLock, done: Callable[[], bool]) -> None:
        """Park until ``done()`` (called under ``lock``) is true; it may raise to stop the wait."""
        with lock:
            if done():
                return  # the common case: no need to count in at all
            self.waiting += 1  # counted in the same locked region as the failed check: no wake-up is lost
        parked = self._parked
        task = trio.lowlevel.current_task()

        def unlist(_: object) -> trio.lowlevel.Abort:  # cancelled while parked
            del parked[task]
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            while True:
                parked[task] = None
                await trio.lowlevel.wait_task_rescheduled(unlist)
                with lock:
                    if done():
                        return
        finally:
            with lock:
                self.waiting -= 1

    @trio.lowlevel.enable_ki_protection
    def wake(self) -> None:
        """In trio: every parked waiter re-checks its condition."""
        parked = self._parked
        if parked:
            tasks = tuple(parked)
            parked.clear()
            for task in tasks:
                trio.lowlevel.reschedule(task)


class TrioInbox:
    """Calls that other threads hand to the trio thread, run in batches: one trio wake-up per batch.

    A call posted while an earlier batch is still waiting to run joins that batch, so
    several stage threads finishing close together wake the trio thread once, not once each.
    """

    _current: trio.lowlevel.RunVar[TrioInbox] = trio.lowlevel.RunVar("chunkline_trio_inbox")

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[..., Any], tuple]] = []
        self.batches = 0  # how many times threads woke the trio thread through this inbox

    @classmethod
    def current(cls) -> TrioInbox:
        """The inbox of the running trio run (made on first use)."""
        try:
            return cls._current.get()
        except LookupError:
            inbox = cls(trio.lowlevel.current_trio_token())
            cls._current.set(inbox)
            return inbox

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: run ``fn(*args)`` in the trio thread soon, in posting order."""
        with self._lock:
            self._calls.append((fn, args))
            if len(self._calls) > 1:
                return  # a batch is already waiting to run: this call joins it
        self._token.run_sync_soon(self._run_batch)

    def _run_batch(self) -> None:
        self.batches += 1
        with self._lock:
            calls, self._calls = self._calls, []
        error: BaseException | None = None
        for fn, args in calls:
            try:
                fn(*args)
            except BaseException as exc:  # a scheduler bug: surface it in trio after the rest ran
                error = error or exc
        del calls
        if error is not None:
            raise error


def _reraise(error: BaseException) -> None:
    raise error


def _unbox(box: list) -> None:
    """Deliver a result in the trio thread, emptying the box the worker thread still holds."""
    deliver, result = box
    box.clear()
    deliver(result)


class DedicatedThread:
    """One daemon thread fed through a queue; results come back through the trio token."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._inbox: TrioInbox | None = None
        self._exited = trio.Event()
        self._stop_requested = False
        # held to queue a call or the stop: no call is ever queued behind the stop, where it would never run
        self._accepting = threading.Lock()

    @property
    def ident(self) -> int | None:
        return None if self._thread is None else self._thread.ident

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._inbox = TrioInbox.current()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        token = self._token
        assert token is not None
        set_thread_timer_slack(STAGE_TIMER_SLACK_NS)  # the handler's timed waits end on time: engine.timer_slack
        try:
            while self._serve_one(token):
                pass
        except trio.RunFinishedError:
            pass  # trio ended while a call ran on (its owner gave up on it): nobody is left to tell
        finally:
            try:
                token.run_sync_soon(self._exited.set)
            except trio.RunFinishedError:
                pass

    def _serve_one(self, token: trio.lowlevel.TrioToken) -> bool:
        """Run one job; this thread keeps no reference to its arguments or result afterwards.

        The delivery and the result travel in a box that the trio side empties, so
        nothing a call took or made outlives it here (a tensor of a closed session).
        """
        job = self._jobs.get()
        if job is _STOP:
            return False
        fn, args, deliver = job
        del job
        inbox = self._inbox
        assert inbox is not None
        try:
            value = fn(*args)
        except BaseException as exc:  # delivered to trio, as any failure of a call is
            box = [deliver, outcome.Error(exc)]
            del fn, args, deliver
            inbox.post(_unbox, box)
            return True
        del fn, args
        on_thread = getattr(deliver, "on_thread", None)
        after = None
        if on_thread is not None:
            try:
                after = on_thread(value)
            except BaseException as exc:  # a scheduler bug: surface it in trio, as a delivery there would
                after = functools.partial(_reraise, exc)
            del on_thread
        if after is NOTHING_LEFT:
            return True
        if after is not None:
            del deliver, value
            inbox.post(after)
            return True
        box = [deliver, outcome.Value(value)]
        del deliver, value
        inbox.post(_unbox, box)
        return True

    def submit(self, fn: Callable[..., Any], args: tuple, deliver: Callable[[outcome.Outcome], None]) -> None:
        """Queue ``fn(*args)``; ``deliver(outcome)`` later runs in the trio thread.

        If ``deliver`` has ``on_thread(value)``, it is offered a successful call's value on
        this thread first; what it returns (if not None) runs in the trio thread instead of
        ``deliver``, and :data:`NOTHING_LEFT` means nothing is left for trio to run. A
        failed call always goes to ``deliver`` in trio.

        The fast path of stage actors: no trio task wakes between the call and
        its delivery. Raises :class:`ThreadStopped` once :meth:`request_stop` was called:
        a call queued behind the stop would never run, and its waiter would wait for good.
        """
        if self._thread is None:
            raise RuntimeError(f"thread {self.name!r} was not started")
        with self._accepting:
            if self._stop_requested:
                raise ThreadStopped(f"thread {self.name!r} was told to stop; it takes no more calls")
            self._jobs.put((fn, args, deliver))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread and return its result.

        A call that has started is never interrupted: cancellation of the
        caller waits for the call to finish (the shield), because abandoning
        model code mid-call would leave its state undefined.
        """
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            done.set()

        self.submit(fn, args, deliver)
        with trio.CancelScope(shield=True):
            await done.wait()
        return box[0].unwrap()

    def request_stop(self) -> None:
        """Tell the thread to end once its queued calls are done (never waits; idempotent)."""
        if self._thread is None:
            return
        with self._accepting:
            if not self._stop_requested:
                self._stop_requested = True
                self._jobs.put(_STOP)

    async def stop(self) -> None:
        """Finish queued calls, then end the thread; waits without blocking trio."""
        if self._thread is None or self._exited.is_set():
            return
        self.request_stop()
        await self._exited.wait()
        self._thread.join()

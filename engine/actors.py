"""Stage actors: the single owner of a stage's state, with one task and one bounded mailbox.

The orchestrator never calls a handler itself. It ``submit``s an invocation to the stage's actor (never waiting: a
full mailbox is :class:`ActorBusyError`) and is called back, in the trio thread, when the invocation resolves. A
completion callback that also offers ``from_thread`` may instead be called on the actor's own thread for a success
(``LocalStageActor`` does so for a synchronous handler); an actor whose ``threadsafe_submit`` is true accepts
``submit`` from such a thread. Session hooks travel through the same mailbox, so a session's cleanup is ordered after
every invocation that was submitted before it.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import outcome
import trio

from states import stage_actor as actor_table
from states.pipeline_session import CloseReason

from .actor_protocol import (
    STAGE_ACTOR_METHODS, ActorHealth, Completion, SessionContext, StageActor, StageInvocation, TaskKey,
)
from .actor_arguments import cancel_on, check_actor_arguments, check_hook_returned, is_async
from .call_watch import CallWatch, timed
from .errors import ActorBusyError, ActorFailedError, FatalStageError, StageCallTimeout, error_text, seconds
from .threads import NOTHING_LEFT, DedicatedThread, ThreadStopped, WaitQueue

__all__ = [  # the protocol's names too: the engine and its users import them from here
    "TaskKey", "SessionContext", "StageInvocation", "ActorHealth", "StageActor", "STAGE_ACTOR_METHODS", "LocalStageActor",
]


@attrs.define
class _Invoke:
    invocation: StageInvocation
    on_done: Completion


@attrs.define
class _CloseSession:
    context: SessionContext
    reason: CloseReason
    done: trio.Event = attrs.Factory(trio.Event)
    result: outcome.Outcome | None = None


class _Delivery:
    """Brings a thread's result back to the actor, in the trio thread."""

    __slots__ = ("actor", "invocation", "on_done", "settled")

    def __init__(self, actor: LocalStageActor, invocation: StageInvocation, on_done: Completion) -> None:
        self.actor = actor
        self.invocation = invocation
        self.on_done = on_done
        self.settled = False  # with a call deadline: the call's result, or the actor's giving up on it, was delivered

    def _claim(self) -> bool:
        """With a call deadline: whether this side delivers, the thread's result or the actor giving up on a call
        past its deadline (whichever comes first). Without one only the result can, and nobody asks."""
        actor = self.actor
        with actor._counts:
            if self.settled:
                return False
            self.settled = True
            actor._outstanding.pop(self, None)
            return True

    def give_up(self, error: BaseException) -> None:
        """In trio: the call ran past its deadline, or waits behind one that did; it resolves as failed now, and its
        result, if it ever comes, is dropped (its session's cleanup need not wait for a call that may never end)."""
        if self._claim():
            self.actor._resolve(self.invocation, self.on_done, outcome.Error(error), from_thread=True)

    def __call__(self, result: outcome.Outcome) -> None:
        actor = self.actor
        if actor._call_watch is not None and not self._claim():
            return
        if actor._machine.state in actor_table.BROKEN and not isinstance(result, outcome.Error):
            result = outcome.Error(ActorFailedError(f"stage actor {actor.name!r} failed: {actor._failure_reason}"))
        actor._resolve(self.invocation, self.on_done, result, from_thread=True)

    def on_thread(self, value: Any) -> Callable[[], None] | object | None:
        """On the actor's thread, for a successful call: complete it right here when the scheduler allows it.

        Returns what the trio thread must run afterwards, :data:`NOTHING_LEFT`, or None when
        the value has to travel to trio as usual (a failed actor, a completion that needs trio).
        """
        actor = self.actor
        from_thread = getattr(self.on_done, "from_thread", None)
        if from_thread is None or not actor._machine.takes_work:
            return None
        if actor._call_watch is not None and not self._claim():  # the actor gave up on the call: delivered already
            return NOTHING_LEFT
        counts = actor._counts
        with counts:
            actor._pending -= 1  # the call is over: its place in the mailbox is free for the next
        finish = from_thread(self.invocation, value)
        if finish is not None:
            return functools.partial(actor._after_thread_delivery, finish)
        # nothing for trio to do: the call is delivered here, and trio is woken only for a barrier
        with counts:
            actor._undelivered -= 1
            return actor._mark_done if actor._quiet.waiting else NOTHING_LEFT


_names = itertools.count()


class LocalStageActor:
    """Runs one handler for every session of a stage, one invocation at a time.

    A synchronous ``handler(invocation) -> {artifact: value}`` runs on one
    dedicated OS thread for every call; an ``async`` handler runs in the
    actor's task. ``session_closer(context, reason)`` (sync or async) releases a
    session's stage state, on the same thread and in mailbox order. ``call_timeout``
    (seconds, None: no deadline): a handler call running that long fails the actor
    (:mod:`engine.call_watch`), with a :class:`StageCallTimeout` as the cause.
    """

    def __init__(
        self,
        handler: Callable[[StageInvocation], Mapping[str, Any] | Awaitable[Mapping[str, Any]]],
        *,
        name: str | None = None,
        mailbox_capacity: int = 1,
        session_closer: Callable[[SessionContext, CloseReason], Any] | None = None,
        call_timeout: float | None = None,
    ) -> None:
        check_actor_arguments(handler, name=name, mailbox_capacity=mailbox_capacity, session_closer=session_closer)
        self.name = name or f"stage-actor-{next(_names)}"
        self._call_watch = None if call_timeout is None else CallWatch(seconds("call_timeout", call_timeout, finite=True))
        self._handler = handler
        self._handler_is_async = is_async(handler)
        self._closer = session_closer
        self._closer_is_async = session_closer is not None and is_async(session_closer)
        self._send, self._receive = trio.open_memory_channel[Any](mailbox_capacity)
        self._machine = actor_table.StageActorMachine()
        self._failure_reason: str | None = None
        self._failure_cause: BaseException | None = None
        self._pending = 0  # invocations submitted and not yet resolved
        # thread calls whose delivery trio has not seen yet (their thread may still hold them)
        self._undelivered = 0
        self._counts = threading.Lock()  # submit may run on another actor's thread (a direct hand-off)
        self._closes = 0  # session hooks queued or running
        # barrier waiters park here until the counts reach zero (no per-call allocation)
        self._quiet = WaitQueue()
        # read by the dedicated thread before each call: once the actor is broken,
        # queued work must not run against its state (plain attribute: GIL-atomic)
        self._refusal: str | None = None
        self._thread: DedicatedThread | None = None
        self._stopped = trio.Event()
        self._capacity = mailbox_capacity
        self._send_closed = False
        self._close_requested = trio.Event()
        self._abandon = trio.Event()  # set when aclose's caller stops waiting for a stuck thread
        self._running_call: trio.CancelScope | None = None  # the async call running in the actor's task
        self._failure_listeners: list[Callable[[str], None]] = []
        # with a call deadline: the thread's undelivered calls and the waits for its hooks, given up when a call overruns
        # (those behind it never ran, and held their sessions' cleanups to 300 s)
        self._outstanding: dict[_Delivery, None] = {}
        self._hook_waits: set[trio.CancelScope] = set()

    # -- lifecycle -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The actor's one task: start the thread, then serve the mailbox until closed."""
        if not self._machine.can(actor_table.Event.STARTED):
            # e.g. the same actor object given to a second orchestrator: it has one owner, once
            raise ValueError(
                f"stage actor {self.name!r} is {self._machine.state.value} and cannot be started again; "
                f"give each orchestrator actors of its own"
            )
        if self._needs_thread():
            self._thread = DedicatedThread(self.name)
            self._thread.start()
        self._machine.apply(actor_table.Event.STARTED)
        task_status.started()
        try:
            async with trio.open_nursery() as watching:
                if self._call_watch is not None:
                    watching.start_soon(self._call_watch.watch, self._call_overran)
                await self._serve()
                watching.cancel_scope.cancel(reason="the actor stopped serving")
        finally:
            with trio.CancelScope(shield=True):
                self._send_closed = True  # no more work: the thread is told to stop next
                if self._thread is not None:
                    self._thread.request_stop()  # even when abandoned: it ends after the stuck call
                if self._thread is not None and not self._abandon.is_set():
                    # a call that never returns keeps the thread: aclose's caller may give up on it
                    async with trio.open_nursery() as thread_stop_wait:
                        thread_stop_wait.start_soon(cancel_on, self._abandon, thread_stop_wait.cancel_scope,
                                                    "aclose's caller abandoned the actor's stuck call")
                        await self._thread.stop()
                        thread_stop_wait.cancel_scope.cancel(reason="the actor's thread stopped")
                if self._machine.can(actor_table.Event.CLOSE):
                    self._machine.apply(actor_table.Event.CLOSE)
                self._stopped.set()

    async def _serve(self) -> None:
        if not self._handler_is_async:
            await self._close_requested.wait()  # the thread serves the calls
            return
        async with self._receive:
            async for message in self._receive:
                if isinstance(message, _Invoke):
                    await self._invoke(message)
                else:
                    await self._close_session(message)
                del message  # the invocation's inputs and outputs die with the call

    def _call_overran(self, error: StageCallTimeout, delivery: _Delivery | None) -> None:
        """The running call passed ``call_timeout``: the actor fails, the call resolves as failed, and the actor's
        close will not wait for it (its thread is left to it; an ``async`` call is cancelled, as when aclose's caller
        gives up on it)."""
        self.fail(str(error), cause=error)
        self._abandon.set()
        if delivery is not None:
            delivery.give_up(error)
        behind = ActorFailedError(f"stage actor {self.name!r} failed: {error} (this call waited behind it)")
        behind.__cause__ = error
        for waiting in list(self._outstanding):  # queued on the stuck thread: they would never run
            waiting.give_up(behind)
        for hook_wait in self._hook_waits:
            hook_wait.cancel(reason="the actor's thread is held by a call past its call_timeout")
        if self._running_call is not None:
            self._running_call.cancel(reason="the call ran past its call_timeout")

    def _needs_thread(self) -> bool:
        return not self._handler_is_async or (self._closer is not None and not self._closer_is_async)

    async def aclose(self) -> None:
        """Stop taking work; queued work finishes first; idempotent."""
        self._send.close()
        self._send_closed = True
        self._close_requested.set()
        if self._machine.state not in actor_table.NOT_STARTED:
            try:
                await self._stopped.wait()
            except trio.Cancelled:
                # the caller's deadline passed with a call still running on the (daemon) thread:
                # leave the thread to it, so the actor's task and the orchestrator can end
                self._abandon.set()
                if self._running_call is not None:  # an async call or hook in the actor's task that never returns
                    self._running_call.cancel(reason="aclose's caller gave up on the actor's running call")
                raise
        elif self._machine.can(actor_table.Event.CLOSE):
            self._machine.apply(actor_table.Event.CLOSE)

    # -- work ------------------------------------------------------------------

    def submit(self, invocation: StageInvocation, on_done: Completion) -> None:
        if not self._machine.takes_work:
            self._check_usable()
        if self._handler_is_async:
            try:
                self._send.send_nowait(_Invoke(invocation, on_done))
            except trio.WouldBlock:
                raise ActorBusyError(f"stage actor {self.name!r}: mailbox is full") from None
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise ActorFailedError(f"stage actor {self.name!r} is closed") from None
        else:
            # the dedicated thread's queue is the mailbox: one call running, up to
            # ``mailbox_capacity`` waiting behind it
            if self._send_closed:
                raise ActorFailedError(f"stage actor {self.name!r} is closed")
            if self._pending > self._capacity:
                raise ActorBusyError(f"stage actor {self.name!r}: mailbox is full")
            assert self._thread is not None
            with self._counts:  # (not through _count: this runs for every call)
                self._pending += 1
                self._undelivered += 1
            delivery = _Delivery(self, invocation, on_done)
            if self._call_watch is not None:  # (a dict's insert is GIL-atomic: submit may run on another thread)
                self._outstanding[delivery] = None
            try:
                self._thread.submit(self._guarded_handler, (invocation, delivery), delivery)
            except ThreadStopped:  # the actor's task ended (its thread told to stop) after the check above
                self._outstanding.pop(delivery, None)
                self._count(pending=-1, undelivered=-1)
                raise ActorFailedError(f"stage actor {self.name!r} is closed") from None
            return
        self._count(pending=1)

    @property
    def threadsafe_submit(self) -> bool:
        """Whether ``submit`` may be called from another thread (a synchronous handler: its queue is)."""
        return not self._handler_is_async

    def _count(self, *, pending: int = 0, undelivered: int = 0) -> bool:
        """Change the counts; returns whether a barrier waits (then someone must wake it in trio)."""
        with self._counts:
            self._pending += pending
            self._undelivered += undelivered
            return self._quiet.waiting > 0

    def _after_thread_delivery(self, finish: Callable[[], None]) -> None:
        """In trio, after a call completed on the thread: the scheduler's leftovers, then barrier waiters."""
        with self._counts:  # (not through _count: this runs for most calls)
            self._undelivered -= 1
        finish()
        if self._quiet.waiting:
            self._mark_done()

    async def _invoke(self, message: _Invoke) -> None:
        inv = message.invocation
        if self._machine.state in actor_table.BROKEN:
            result: outcome.Outcome = outcome.Error(self._failed())
        else:
            with timed(self._call_watch, inv):  # as on the thread (_guarded_handler)
                result = await self._call(self._handler, True, inv)
        self._resolve(inv, message.on_done, result)

    def _guarded_handler(self, invocation: StageInvocation, delivery: _Delivery) -> Any:
        """Runs on the dedicated thread: refuse work once the actor is broken."""
        if self._refusal is not None:
            raise ActorFailedError(f"stage actor {self.name!r} failed: {self._refusal}")
        watch = self._call_watch
        if watch is not None:
            watch.started(invocation, delivery)
        try:
            return self._handler(invocation)
        except FatalStageError as exc:
            self._refusal = error_text(exc)
            raise
        finally:
            if watch is not None:
                watch.ended()

    def _mark_done(self) -> None:
        if self._pending == 0 and self._undelivered == 0:
            self._quiet.wake()

    def _resolve(self, invocation: StageInvocation, on_done: Completion, result: outcome.Outcome, *, from_thread: bool = False) -> None:
        self._count(pending=-1, undelivered=-1 if from_thread else 0)
        self._mark_done()
        # the invocation that surfaced a fatal error is resolved first, so its session
        # keeps that error; every other session then fails through the listeners
        on_done(invocation, result)
        if isinstance(result, outcome.Error) and isinstance(result.error, FatalStageError):
            self.fail(error_text(result.error), cause=result.error)

    async def _call(self, fn: Callable[..., Any], is_async: bool, *args: Any) -> outcome.Outcome:
        if is_async:
            # a running call is never interrupted mid-chunk, unless aclose's caller gave up on it
            with trio.CancelScope(shield=True) as self._running_call:
                if self._abandon.is_set():
                    self._running_call.cancel(reason="aclose's caller gave up on the actor's calls")
                result = await outcome.acapture(fn, *args)
            self._running_call = None
            if isinstance(result, outcome.Error) and isinstance(result.error, trio.Cancelled):
                return outcome.Error(ActorFailedError(f"stage actor {self.name!r} closed while this call still ran"))
            return result
        assert self._thread is not None
        return await outcome.acapture(self._thread.call, fn, *args)

    async def close_session(self, context: SessionContext, reason: CloseReason) -> None:
        """Run the session hook through the mailbox, after everything submitted before it."""
        if self._closer is None:
            return
        self._check_usable()
        if not self._handler_is_async and self._send_closed:
            raise ActorFailedError(f"stage actor {self.name!r} is closed")
        self._closes += 1
        try:
            if not self._handler_is_async:
                # through the thread's queue, behind every invocation submitted before it
                await self._barrier_then_close(context, reason)
                return
            message = _CloseSession(context, reason)
            try:
                await self._send.send(message)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise ActorFailedError(f"stage actor {self.name!r} is closed") from None
            await message.done.wait()
            assert message.result is not None
            message.result.unwrap()
        finally:
            self._closes -= 1
            self._mark_done()

    async def _barrier_then_close(self, context: SessionContext, reason: CloseReason) -> None:
        if self._closer_is_async:
            await self._quiet.wait_until(self._counts, lambda: not self._pending)
            await self._async_hook_beside_thread(context, reason)
        else:
            await self._hook_on_thread(context, reason)
        if self._machine.state in actor_table.BROKEN:
            raise self._failed()

    async def _async_hook_beside_thread(self, context: SessionContext, reason: CloseReason) -> None:
        """An ``async`` hook of an actor whose calls run on its thread runs beside them, unseen by the call watch (one
        call at a time): ``call_timeout`` bounds it here (it was never timed), and so may the close deadline."""
        timeout = math.inf if self._call_watch is None else self._call_watch.call_timeout
        with trio.move_on_after(timeout) as hook:
            await self._closer(context, reason)  # type: ignore[misc]
        if hook.cancelled_caught:
            self._call_overran(StageCallTimeout(f"its session_closer for session {context.session_id!r} ran past its "
                                                f"call_timeout of {timeout:g} s"), None)

    async def _hook_on_thread(self, context: SessionContext, reason: CloseReason) -> None:
        """Run the synchronous hook on the thread; the caller's deadline stops the wait, not the hook.

        The hook counts (for ``barrier``) until it has really returned, even if its caller gave up.
        """
        assert self._thread is not None
        done = trio.Event()
        box: list[outcome.Outcome] = []
        self._closes += 1

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            self._closes -= 1
            self._mark_done()
            done.set()

        self._thread.submit(self._watched_hook, (context, reason), deliver)  # close_session checked it takes work
        with trio.CancelScope() as waiting:  # cancelled when a call (this hook, one ahead of it) overruns
            self._hook_waits.add(waiting)
            try:
                await done.wait()
            finally:
                self._hook_waits.discard(waiting)
        if not box:  # the thread is held past call_timeout: this hook may never run, or never return
            raise self._failed()
        box[0].unwrap()

    def _watched_hook(self, context: SessionContext, reason: CloseReason) -> None:
        """The synchronous session hook on its thread, timed as a call is (one returning an awaitable freed nothing)."""
        with timed(self._call_watch, context):
            check_hook_returned(self.name, self._closer(context, reason))  # type: ignore[misc]

    def _failed(self) -> ActorFailedError:  # what a call or hook of this broken actor resolves as
        return ActorFailedError(f"stage actor {self.name!r} failed: {self._failure_reason}")

    async def _close_session(self, message: _CloseSession) -> None:
        if self._machine.state in actor_table.BROKEN:
            message.result = outcome.Error(self._failed())
        elif self._closer_is_async:
            with timed(self._call_watch, message.context):  # in the actor's task, ahead of the calls behind it
                message.result = await self._call(self._closer, True, message.context, message.reason)
        else:  # on the thread, timed there
            message.result = await self._call(self._watched_hook, False, message.context, message.reason)
        message.done.set()

    async def barrier(self) -> None:
        """Wait until every submitted invocation and every session hook has finished."""
        await self._quiet.wait_until(self._counts, self._quiet_now)

    def _quiet_now(self) -> bool:
        return not (self._pending or self._closes or self._undelivered)

    # -- health ----------------------------------------------------------------

    def fail(self, reason: str, *, cause: BaseException | None = None) -> None:
        """Mark the actor itself broken; it runs no more work (queued items resolve as failed).

        Call in the trio thread. Failure listeners (the orchestrator) hear of it at once,
        so sessions waiting on this actor fail instead of waiting forever; ``cause`` (the
        exception that broke it) becomes their errors' ``__cause__``.
        """
        if self._machine.can(actor_table.Event.FAIL):
            self._machine.apply(actor_table.Event.FAIL)
            self._failure_reason = reason
            self._failure_cause = cause
            self._refusal = self._refusal or reason
            for listener in list(self._failure_listeners):
                listener(reason)

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(reason)`` runs in the trio thread when the actor fails."""
        self._failure_listeners.append(listener)

    def health(self) -> ActorHealth:
        return ActorHealth(self._machine.state, self._pending, self._failure_reason, self._failure_cause)

    def is_healthy(self) -> bool:
        """The cheap form of ``health().healthy`` the scheduler asks before every admission."""
        return self._machine.takes_work

    def _check_usable(self) -> None:
        state = self._machine.state
        if state in actor_table.BROKEN:
            raise self._failed()
        if state in actor_table.RETIRED:
            raise ActorFailedError(f"stage actor {self.name!r} is closed")

    @property
    def thread_ident(self) -> int | None:
        """The OS thread that runs this actor's synchronous calls (None before start)."""
        return None if self._thread is None else self._thread.ident


"""The scheduler core: the one owner of session runtimes, reservations and usage.

It joins artifacts by (session, sequence), admits ready work to the stages'
actors under the spec's limits, holds a :class:`Reservation` for every
admitted invocation until its result is accepted or dropped, and emits
outputs in sequence order.

Its state is changed under one lock, from the trio thread or, for one case,
from a stage's own thread: an actor whose calls run on a dedicated thread
completes a successful invocation right there (``CoreCompletion.from_thread``),
and the admission that completion unblocks submits the next stage from that
same thread. A chunk's hop from one stage to the next is then one thread
wake-up (the next stage's), not two through the trio thread. What only trio may
do (wake trio tasks that wait, start background cleanups, submit to actors that
take work in trio) is collected meanwhile (:mod:`engine.handoff`) and handed to
trio afterwards; when there is none, the trio thread is not woken at all.

:class:`~engine.session.Session` and :class:`~engine.shutdown.SessionShutdown`
talk to it through the methods listed under "interface" below and nothing else.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import outcome
import trio

from states import pipeline_session as table

from .actor_failures import ActorFailures
from .actor_protocol import new_invocation, new_task_key
from .actors import StageActor, StageInvocation, TaskKey
from .blockers import ACTOR_BUSY, Blocker, first_blocker
from .completion import read_result, record_result
from .errors import ActorBusyError, SessionExistsError, drop_frame_locals
from .graph import StageGraph
from .handoff import CoreCompletion, Leftovers, TrioHandoff
from .ingress import check_final_sequence, check_ingress, has_room, refuse_past_final, room_query
from .metrics import Diagnostics
from .reservations import UsageBook
from .runtime import Lane, SessionRuntime
from .spec import StageSpec
from .threads import WaitQueue
from .turns import admit_in_turn

__all__ = ["SchedulerCore"]

Event = table.Event


def _locked(method: Callable) -> Callable:
    """Run a core method under the core's lock (a stage's own thread may be completing work)."""

    @functools.wraps(method)
    def locked(self: SchedulerCore, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class SchedulerCore:
    """Owns every session runtime of one orchestrator and schedules their work."""

    def __init__(
        self,
        graph: StageGraph,
        actors: Mapping[str, StageActor],
        on_failed: Callable[[SessionRuntime], None],
    ) -> None:
        self.graph = graph
        self._actors = dict(actors)
        self._group_limit = {g.name: g.max_concurrency for g in graph.spec.resource_groups}
        self._usage = UsageBook(graph.stage_ids, self._group_limit)
        self._turns: dict[str, deque[Lane]] = {s: deque() for s in graph.stage_ids}  # round robin per stage
        # the pump's look-up: a stage's bit -> the stage, its id, its global limit, its turns
        self._turns_at = {
            bit: (stage, stage.stage_id, stage.max_in_flight_global, self._turns[stage.stage_id])
            for bit, stage in graph.at_bit.items()
        }
        self._sessions: dict[str, SessionRuntime] = {}
        self._next_epoch = 1
        self._next_request = 1
        self._counters: Counter[str] = Counter()  # keyed by the Diagnostics field names
        self._pumping = False
        self._dirty = 0  # stages to look at again (the graph's bit masks)
        # A stage's own thread may complete an invocation and admit the next stage itself (one
        # thread wake-up per hop); the lock makes that and every trio-side call one at a time.
        # While a thread is in the core, what only trio may do is collected, then handed to trio.
        self.lock = threading.RLock()
        self._now = trio.lowlevel.current_clock().current_time
        self._latency_anchor = graph.spec.latency_anchor_artifact
        # whether each stage's actor may be submitted to from a stage's thread (fixed for its life)
        self._threadsafe = {s: bool(getattr(a, "threadsafe_submit", False)) for s, a in self._actors.items()}
        # on_failed starts the failed session's cleanup in the orchestrator's nursery
        self._handoff = TrioHandoff(on_failed)
        # ``_blocker(rt, stage)``: the first limit holding the stage's next item back (asked on every admission)
        self._blocker: Callable[[SessionRuntime, StageSpec], Blocker | None] = functools.partial(
            first_blocker, graph, self._usage, self._group_limit
        )
        self._failures = ActorFailures(self._actors, self._sessions.values, self._fail)
        # stage -> the stages a completion there may unblock: its own, its consumers' (graph.after_completion) and
        # every stage its actor also serves (the call freed a place in that actor's mailbox: one refused busy waits)
        shared = graph.sharing(self._actors)
        self._after_completion = {stage_id: mask | shared[stage_id] for stage_id, mask in graph.after_completion.items()}
        self.completion = CoreCompletion(self)

    # == interface: sessions ===============================================================

    @_locked
    def open_session(self, session_id: str, final_sequence_id: int | None) -> SessionRuntime:
        """A fresh runtime (a new epoch); a terminal session's id may be reused."""
        existing = self._sessions.get(session_id)
        if existing is not None:
            raise SessionExistsError(
                f"session {session_id!r} is {existing.state.value}; close it "
                f"(or retry its cleanup) before reusing the id"
            )
        runtime = SessionRuntime(session_id, self._next_epoch, final_sequence_id, self.graph.scan_order)
        self._next_epoch += 1
        self._sessions[session_id] = runtime
        for stage_id, turns in self._turns.items():
            turns.append(runtime.lanes[stage_id])
        return runtime

    def get(self, session_id: str) -> SessionRuntime | None:
        return self._sessions.get(session_id)

    @_locked
    def runtimes(self) -> tuple[SessionRuntime, ...]:
        """Sessions that are live or poisoned (terminal ones are forgotten)."""
        return tuple(self._sessions.values())

    @_locked
    def forget(self, rt: SessionRuntime) -> None:
        """Drop a settled session; its handle stays readable."""
        if self._sessions.get(rt.session_id) is rt:
            del self._sessions[rt.session_id]
            for stage_id, turns in self._turns.items():
                try:
                    turns.remove(rt.lanes[stage_id])
                except ValueError:
                    pass

    # == interface: ingress and outputs (Session) =============================================

    def try_push(self, rt: SessionRuntime, seq: int, artifacts: Mapping[str, Any]) -> bool:
        """Admit all of ``artifacts`` for ``seq`` now, or nothing."""
        graph = self.graph
        with self.lock:
            if not check_ingress(graph, rt, seq, artifacts):  # raises for ingress that can never run
                return False
            now = self._now()
            anchor = self._latency_anchor
            if anchor is None or anchor in artifacts:
                rt.record_ingress(seq, now)
            targets, consumes, consumers_of = graph.targets, graph.consumes, graph.consumers_of
            dirty = 0
            for artifact, value in artifacts.items():
                rt.add_slot(seq, artifact, value, targets[artifact], now, consumes)
                dirty |= consumers_of[artifact]
            if seq > rt.highest_ingress:
                rt.highest_ingress = seq
            self._pump(dirty, now)
            return True

    async def push(self, rt: SessionRuntime, seq: int, artifacts: Mapping[str, Any]) -> None:
        await rt.room.wait_until(self.lock, functools.partial(self.try_push, rt, seq, artifacts))

    async def wait_until(self, queue: WaitQueue, done: Callable[[], bool]) -> None:
        """Park on one of a session's wait queues until ``done()``, checked under the core's lock."""
        await queue.wait_until(self.lock, done)

    @_locked
    def has_room(self, rt: SessionRuntime, artifacts: Iterable[str], seq: int | None = None, *,
                 refuse_past_end: bool = False) -> bool:
        """Whether the named ingress artifacts have room (for ``seq``); ``refuse_past_end``: raise as a push would
        for a ``seq`` past the final sequence (a wait for its room would not end)."""
        names = room_query(self.graph, artifacts, seq)
        if refuse_past_end and seq is not None:
            refuse_past_final(rt, seq)
        return rt.admitting and has_room(self.graph, rt, names, seq)

    @_locked
    def finish_inputs(self, rt: SessionRuntime, final_sequence_id: int) -> None:
        if check_final_sequence(self.graph, rt, final_sequence_id):
            rt.final_sequence_id = final_sequence_id
            self._wake(*rt.everyone)
            self._pump(self.graph.all_stages)

    def take_outputs(self, rt: SessionRuntime, most: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """The outputs not yet taken, oldest first: all of them, or at most ``most`` (a reader taking one at a time
        leaves, when it stops, none it never got)."""
        with self.lock:
            outputs = rt.outputs
            if not outputs:
                return []
            if most is None or most >= len(outputs):
                items = list(outputs)
                outputs.clear()
            else:
                items = [outputs.popleft() for _ in range(most)]
            self._wake(rt.changed)  # output room freed: a drain may proceed
            self._pump(self.graph.output_producers)
            return items

    @_locked
    def busy(self, rt: SessionRuntime) -> bool:
        """Something of the session runs, or could start now (backpressured work cannot)."""
        return bool(rt.reservations or rt.handoffs_queued) or (rt.starting_accepted_work and self._admissible(rt))

    @_locked
    def blocker(self, rt: SessionRuntime, stage_id: str, seq: int) -> Blocker | None:
        """The limit that last held ``seq`` back at ``stage_id`` once its inputs were ready."""
        return rt.blockers[stage_id].get(seq)

    # == interface: shutdown (SessionShutdown) ================================================

    @property
    def topological_order(self) -> tuple[str, ...]:
        return self.graph.topological_order

    def actor(self, stage_id: str) -> StageActor:
        return self._actors[stage_id]

    @_locked
    def stop(self, rt: SessionRuntime, event: table.Event) -> bool:
        """Apply a stop event (CLOSE, CANCEL, SHUT_DOWN, DRAIN_TIMED_OUT) if the table allows it now."""
        if not rt.machine.can(event):
            return False
        rt.machine.apply(event)
        if rt.state in table.DROPPING_WORK:
            rt.discard_buffers()
            if table.DROPS_OUTPUTS[event]:
                rt.outputs.clear()
        self._wake(*rt.everyone)
        self._pump(self.graph.all_stages)
        return True

    @_locked
    def work_settled(self, rt: SessionRuntime) -> bool:
        """Nothing of the session runs, and (draining) nothing left can ever start.

        With nothing in flight and ingress closed, an item held back only by its
        own full downstream edge can never move: the edge empties only when its
        target runs, and nothing of this session is running or admissible.
        """
        if rt.reservations or rt.handoffs_queued:
            return False
        if not rt.starting_accepted_work:
            return True
        for stage in self.graph.scan_order:
            if rt.next_ready(stage) is None:
                continue
            blocker = self._blocker(rt, stage)
            if blocker is None or not blocker.waits_on_own_downstream:
                return False
        return True

    @_locked
    def drop_buffers(self, rt: SessionRuntime) -> None:
        """Drop the inputs a settled session can never consume now."""
        rt.discard_buffers()

    @_locked
    def check_released(self, rt: SessionRuntime) -> int:
        """Count (then clear) what the session still holds after its stages released it."""
        leaks = rt.leaked_slots() + self._usage.drift(r.reservations for r in self._sessions.values())
        if leaks:
            self._counters["slot_leaks"] += leaks
            rt.discard_buffers()
        return leaks

    @_locked
    def count_cleanup_failure(self) -> None:
        self._counters["cleanup_failures"] += 1

    # == interface: whole orchestrator ===========================================================

    @_locked
    def diagnostics(self) -> Diagnostics:
        return Diagnostics(**self._counters)

    @_locked
    def resource_group_usage(self, name: str) -> int:
        if name not in self._usage.by_group:
            raise KeyError(f"unknown resource group {name!r}")
        return self._usage.by_group[name]

    @_locked
    def in_flight(self, stage_id: str) -> int:
        return self._usage.by_stage[stage_id]

    @_locked
    def advance(self, rt: SessionRuntime, event: table.Event) -> None:
        """Apply a shutdown phase's event (the table decides; a stage thread cannot interleave)."""
        rt.machine.apply(event)

    def on_actor_failed(self, stage_id: str) -> Callable[[str], None]:
        """The failure listener to give the stage's actor."""

        def listener(reason: str) -> None:
            with self.lock:
                self._failures.heard(stage_id, reason)

        return listener

    # == completion (the actors' callback) ========================================================

    @_locked
    def complete(self, invocation: StageInvocation, result: outcome.Outcome) -> None:
        """Called by an actor, in the trio thread, once per submitted invocation."""
        if isinstance(result, outcome.Error):
            self._complete(invocation, None, result.error)
        else:
            self._complete(invocation, result.value, None)

    def _complete(self, invocation: StageInvocation, value: Any, error: BaseException | None) -> None:
        """Accept one invocation's result (``value``) or failure (``error``), unless it no longer counts."""
        if error is not None:
            drop_frame_locals(error)  # the call's frames held its inputs for as long as the error is kept
        key = invocation.key
        rt = self._sessions.get(key.session_id)
        reservation = None if rt is None else rt.reservations.held.get((key.stage_id, key.sequence_id))
        # the key travels with the invocation: the same object unless an actor rebuilt it (a worker process)
        if reservation is None or (reservation.key is not key and reservation.key != key):
            self._count_unheld(rt, key)
            return
        self._usage.release(rt.reservations, reservation)
        stage_id = key.stage_id
        now = reservation.timing.completed_at = self._now()
        try:
            if error is not None:
                self._failures.call_failed(rt, stage_id, error)
            elif rt.machine.starting_accepted_work:  # else cancelled or failed meanwhile: the result is dropped
                stage = self.graph.stages[stage_id]
                result = read_result(stage, key.sequence_id, value)
                if type(result) is not dict:
                    self._fail(rt, result)
                elif record_result(self.graph, rt, stage, key.sequence_id, result, now):
                    self._wake(rt.emitted)
        finally:
            self._wake(rt.changed)
            self._pump(self._after_completion[stage_id], now)

    def _count_unheld(self, rt: SessionRuntime | None, key: TaskKey) -> None:
        """Count a result that holds no reservation: why it no longer counts."""
        if rt is None or key.request_id >= self._next_request:
            self._counters["orphaned_results"] += 1
        elif rt.epoch != key.session_epoch:
            self._counters["stale_epoch_results"] += 1
        else:
            self._counters["duplicate_results"] += 1

    def complete_from_thread(self, invocation: StageInvocation, value: Any) -> Callable[[], None] | None:
        """Complete a successful invocation (its ``value``) on the stage's own thread; returns what trio must then run.

        The completion admits whatever it unblocks right here, so the next stage's thread is
        woken by this one, not through the trio thread. Wake-ups of trio tasks that wait,
        background cleanups and submits to actors that need trio are collected and returned
        (None when there are none: the trio thread is not woken at all). Until trio has run
        them, the session counts as busy: an idle wait cannot see it settled while its
        reader's wake-up (or a trio-side submit) is still queued.
        """
        with self.lock:
            self._handoff.begin()
            try:
                self._complete(invocation, value, None)
            finally:
                left = self._handoff.end()
            if left is None:
                return None
            rt = self._sessions.get(invocation.key.session_id)
            if rt is not None:
                rt.handoffs_queued += 1
        return functools.partial(self._run_handoff, rt, left)

    def _run_handoff(self, rt: SessionRuntime | None, left: Leftovers) -> None:
        with self.lock:
            try:
                self._handoff.run(left, self._pump)
            finally:
                if rt is not None:
                    rt.handoffs_queued -= 1
                    self._wake(rt.changed)

    def _wake(self, *queues: WaitQueue) -> None:
        """Wake the session wait queues that have waiters (off trio: once the thread is done)."""
        for queue in queues:
            if queue.waiting:
                self._handoff.wake(queue)

    # == failure ==================================================================================

    def _fail(self, rt: SessionRuntime, error: BaseException) -> None:
        """Fail one session: stop it, drop its buffers, clean it up in the background."""
        if not rt.machine.can(Event.FAIL):
            return
        needs_cleanup = rt.state not in table.DROPPING_WORK  # a cancel or shutdown already runs it
        rt.machine.apply(Event.FAIL)
        rt.error = error
        rt.discard_buffers()
        if table.DROPS_OUTPUTS[Event.FAIL]:
            rt.outputs.clear()
        self._wake(*rt.everyone)
        if needs_cleanup:
            self._handoff.clean_up(rt)

    # == scheduling ===============================================================================

    def _pump(self, stages: int, now: float | None = None) -> None:
        """Admit ready work, looking only at the stages an event may have made admissible (a bit mask).

        Admitting a stage frees edge room, so its upstream producers are looked
        at again. Re-entrant calls (a completion inside ``submit``) fold into the
        running pump. ``now``: the caller's own time stamp, the admissions' too (else each takes one).
        """
        dirty = self._dirty = self._dirty | stages
        if self._pumping or not dirty:
            return
        self._pumping = True
        try:
            turns_at, try_admit, by_stage = self._turns_at, self._try_admit, self._usage.by_stage
            while dirty:
                bit = dirty & -dirty  # the most downstream stage marked: finishing work frees room upstream
                self._dirty = dirty ^ bit
                stage, stage_id, limit, turns = turns_at[bit]
                if by_stage[stage_id] < limit:  # else busy: nothing to look at
                    # admitting may mark more stages (upstream room, a completion inside submit)
                    if len(turns) == 1:  # one session: no turns to take (most looks find nothing ready)
                        lane = turns[0]
                        if lane.ready and try_admit(lane, now) and stage.max_in_flight_per_session > 1:
                            while try_admit(lane, now):
                                pass
                    elif turns:
                        admit_in_turn(stage, turns, by_stage, functools.partial(try_admit, now=now))
                dirty = self._dirty
        finally:
            self._pumping = False

    def _admissible(self, rt: SessionRuntime) -> bool:
        return any(
            rt.next_ready(stage) is not None and self._blocker(rt, stage) is None
            for stage in self.graph.scan_order
        )

    def _try_admit(self, lane: Lane, now: float | None) -> bool:
        seq = lane.next_ready()  # the cheaper check first: most calls find nothing ready
        rt = lane.rt
        if seq is None or not rt.machine.starting_accepted_work:
            return False
        stage = lane.stage
        stage_id = stage.stage_id
        blocker = self._blocker(rt, stage)
        if blocker is not None:
            rt.blockers[stage_id][seq] = blocker
            return False
        actor = self._actors[stage_id]
        if self._handoff.off_trio and not self._threadsafe[stage_id]:
            self._handoff.submit_in_trio(self.graph.bit[stage_id])  # this actor takes work in trio only
            return False
        if not actor.is_healthy():
            self._failures.actor_failed(stage_id, actor.health().failure_reason, None)
            return False
        request = self._next_request
        self._next_request = request + 1
        key = new_task_key((rt.session_id, rt.epoch, seq, stage_id, request))
        # everything the invocation holds is taken before submit: an actor may complete it inside submit
        inputs, timing = rt.take_inputs(stage_id, seq, stage.consumes)
        timing.admitted_at = self._now() if now is None else now
        reservation = self._usage.take(rt.reservations, stage, key, timing)
        first = seq == 0 if lane.strict else not lane.taken  # the session's first call at this stage
        lane.taken.add(seq)
        try:
            actor.submit(new_invocation((key, inputs, first, seq == rt.final_sequence_id)), self.completion)
        except Exception as exc:
            if rt.reservations.get(stage_id, seq) is reservation:
                self._usage.release(rt.reservations, reservation)
                lane.taken.discard(seq)
                rt.restore_inputs(stage_id, seq, inputs, timing)
            if isinstance(exc, ActorBusyError):
                rt.blockers[stage_id][seq] = ACTOR_BUSY
            elif not actor.health().healthy:
                self._failures.actor_failed(stage_id, actor.health().failure_reason, exc)
            else:
                self._fail(rt, exc)
            return False
        self._dirty |= self.graph.upstream[stage_id]  # edge room freed upstream
        if stage_id in self.graph.ingress_consumers:
            self._wake(rt.room, rt.changed)
        else:
            self._wake(rt.changed)
        return True

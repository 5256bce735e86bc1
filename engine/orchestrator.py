"""The trio streaming pipeline orchestrator.

One orchestrator schedules every session of one pipeline: it joins artifacts
by (session, sequence), admits ready work to the stages' actors under the
spec's limits, reserves downstream room before work runs, emits outputs in
sequence order, and runs each session's ordered shutdown from the
pipeline-session table. All of its state lives in the trio thread: actors call
back into it there, so it needs no locks.

    async with open_orchestrator(spec, actors) as orch:
        async with orch.session("s1", final_sequence_id=9) as session:
            await session.push(0, {"image": img, "control": ctl})
            async for seq, artifacts in session.outputs():
                ...
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from states import pipeline_session as table
from states.pipeline_session import CloseReason

from .actors import StageActor, StageInvocation, TaskKey
from .completion import CompletionMixin
from .errors import (
    ActorBusyError,
    ActorFailedError,
    OrchestratorClosedError,
    OrchestratorCloseError,
    SessionCleanupError,
    SessionExistsError,
    UnknownSessionError,
)
from .ingress import IngressMixin
from .metrics import Diagnostics
from .runtime import SessionRuntime
from .session import Session
from .shutdown import SessionShutdown
from .spec import PipelineSpec, StageOrdering

__all__ = ["Orchestrator", "open_orchestrator"]

State = table.State
Event = table.Event


@attrs.define
class _Counters:
    stale_epoch_results: int = 0
    orphaned_results: int = 0
    duplicate_results: int = 0
    cleanup_failures: int = 0
    slot_leaks: int = 0


@asynccontextmanager
async def open_orchestrator(
    spec: PipelineSpec,
    actors: Mapping[str, StageActor],
    *,
    close_timeout: float = 300.0,
) -> AsyncIterator[Orchestrator]:
    """Start the actors in a nursery, yield the orchestrator, then close everything.

    On exit every live session is shut down (reason ``shutdown``) and the
    actors are closed in reverse topological order, all within
    ``close_timeout``. An exception from the body propagates as itself.
    """
    check_actor_map(spec, actors)
    body_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        orch = Orchestrator(spec, actors, nursery)
        try:
            await orch._start_actors()
            try:
                yield orch
            except Exception as exc:  # re-raised below, outside the nursery, unwrapped
                body_error = exc
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await orch.aclose(timeout=close_timeout)
                except OrchestratorCloseError as exc:
                    if body_error is None:
                        body_error = exc
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error


def check_actor_map(spec: PipelineSpec, actors: Mapping[str, StageActor]) -> None:
    """Exactly one actor per stage: a ValueError naming what is missing or unknown."""
    stage_ids = {s.stage_id for s in spec.stages}
    if set(actors) != stage_ids:
        missing = sorted(stage_ids - set(actors))
        extra = sorted(set(actors) - stage_ids)
        raise ValueError(f"actors must match the spec's stages exactly: missing {missing}, unknown {extra}")


class Orchestrator(IngressMixin, CompletionMixin):
    """Schedules sessions across stage actors. Create it with :func:`open_orchestrator`."""

    def __init__(self, spec: PipelineSpec, actors: Mapping[str, StageActor], nursery: trio.Nursery) -> None:
        check_actor_map(spec, actors)
        stage_ids = tuple(s.stage_id for s in spec.stages)
        self.spec = spec
        self.actors = dict(actors)
        self._nursery = nursery
        self._stages = {s.stage_id: s for s in spec.stages}
        self._stage_ids = stage_ids
        self._consumes = {s.stage_id: s.consumes for s in spec.stages}
        self._consumes_sorted = {s.stage_id: tuple(sorted(s.consumes)) for s in spec.stages}
        self._targets: dict[str, tuple[str, ...]] = {}
        self._capacity: dict[tuple[str, str], int] = {}
        for edge in spec.edges:
            self._targets[edge.artifact] = self._targets.get(edge.artifact, ()) + (edge.target_stage,)
            self._capacity[(edge.artifact, edge.target_stage)] = edge.capacity_per_session
        # admission scans downstream stages first: finishing work frees room upstream
        self._scan_order = tuple(self._stages[s] for s in reversed(spec.topological_order))
        self._outputs = spec.output_artifacts
        self._group_limit = {g.name: g.max_concurrency for g in spec.resource_groups}
        self._group_usage = {g.name: 0 for g in spec.resource_groups}
        self._in_flight_global = {s: 0 for s in stage_ids}
        # per-stage round robin over sessions: a session served goes to the back
        self._turns: dict[str, deque[str]] = {s: deque() for s in stage_ids}
        self._sessions: dict[str, SessionRuntime] = {}
        self._next_epoch = 1
        self._next_request = 1
        self._counters = _Counters()
        self._closing = False
        self._closed = trio.Event()
        self._pumping = False
        self._dirty: set[str] = set()
        # which stages an event can make admissible (see _pump)
        self._upstream = {
            s.stage_id: frozenset(self.spec.producers[a] for a in s.consumes if a in self.spec.producers)
            for s in spec.stages
        }
        groups = {s.resource_group for s in spec.stages if s.resource_group is not None}
        peers = {g: frozenset(s.stage_id for s in spec.stages if s.resource_group == g) for g in groups}
        self._after_completion = {
            s.stage_id: frozenset(
                {s.stage_id}
                | {t for a in s.produces for t in self._targets.get(a, ())}
                | (peers[s.resource_group] if s.resource_group is not None else frozenset())
            )
            for s in spec.stages
        }
        self._output_producers = frozenset(self.spec.producers[a] for a in spec.output_artifacts)
        self._shutdowns = SessionShutdown(self)

    async def _start_actors(self) -> None:
        """Start each actor once, in topological order of its first stage.

        One actor object may serve several stages (e.g. decode co-located in the denoise
        worker group): it is started once and closed once; its failure is reported for each
        stage it serves, and its session hook runs once per stage.
        """
        started: set[int] = set()
        for stage_id in self.spec.topological_order:
            actor = self.actors[stage_id]
            add_listener = getattr(actor, "add_failure_listener", None)
            if add_listener is not None:
                add_listener(lambda reason, stage_id=stage_id: self._fail_actor_sessions(stage_id, reason))
            if id(actor) not in started:
                started.add(id(actor))
                await self._nursery.start(actor.run)

    # -- sessions ------------------------------------------------------------

    def create_session(self, session_id: str, *, final_sequence_id: int | None = None) -> Session:
        """Open a session (a fresh epoch); a terminal session's id may be reused."""
        if self._closing:
            raise OrchestratorClosedError("the orchestrator is closing; no new sessions")
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if final_sequence_id is not None and final_sequence_id < 0:
            raise ValueError(f"final_sequence_id must be >= 0, got {final_sequence_id}")
        existing = self._sessions.get(session_id)
        if existing is not None:
            raise SessionExistsError(
                f"session {session_id!r} is {existing.state.value}; close it "
                f"(or retry its cleanup) before reusing the id"
            )
        runtime = SessionRuntime(session_id, self._next_epoch, final_sequence_id, self._stage_ids)
        self._next_epoch += 1
        self._sessions[session_id] = runtime
        for turns in self._turns.values():
            turns.append(session_id)
        return Session(self, runtime)

    @asynccontextmanager
    async def session(self, session_id: str, *, final_sequence_id: int | None = None, close_timeout: float = 60.0) -> AsyncIterator[Session]:
        """A session that is drained and closed on exit (cancelled if the body raised)."""
        handle = self.create_session(session_id, final_sequence_id=final_sequence_id)
        try:
            yield handle
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._shutdown(handle._runtime, CloseReason.CANCELLED, cancel=True, timeout=close_timeout)
            raise
        else:
            await self._shutdown(handle._runtime, CloseReason.CLOSED, cancel=False, timeout=close_timeout)

    def get_session(self, session_id: str) -> Session:
        runtime = self._sessions.get(session_id)
        if runtime is None:
            raise UnknownSessionError(session_id)
        return Session(self, runtime)

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Sessions that are live or poisoned (terminal ones are forgotten)."""
        return tuple(self._sessions)

    # -- scheduling ------------------------------------------------------------

    def _pump(self, stages: Iterable[str] | None = None) -> None:
        """Admit every piece of ready work the limits allow, looking only where it may have appeared.

        ``stages`` names the stages whose admissibility an event may have changed
        (None: all of them); admitting a stage frees edge room, so its upstream
        producers are looked at again. Re-entrant calls fold into the running pump.
        """
        self._dirty.update(self._stage_ids if stages is None else stages)
        if self._pumping:
            return
        self._pumping = True
        try:
            dirty = self._dirty
            while dirty:
                for stage in self._scan_order:
                    if stage.stage_id in dirty:
                        dirty.discard(stage.stage_id)
                        self._admit_stage(stage)
        finally:
            self._pumping = False

    def _admit_stage(self, stage: Any) -> None:
        stage_id = stage.stage_id
        turns = self._turns[stage_id]
        served: list[str] = []
        for session_id in tuple(turns):
            if self._in_flight_global[stage_id] >= stage.max_in_flight_global:
                break
            rt = self._sessions.get(session_id)
            if rt is None or not rt.ready[stage_id] or not rt.starting_accepted_work:
                continue
            while self._try_admit(rt, stage):
                if session_id not in served:
                    served.append(session_id)
        for session_id in served:
            turns.remove(session_id)
            turns.append(session_id)

    def _candidate(self, rt: SessionRuntime, stage: Any) -> int | None:
        ready = rt.ready[stage.stage_id]
        if stage.ordering is StageOrdering.PER_SESSION_STRICT:
            frontier = rt.taken[stage.stage_id].below
            return frontier if frontier in ready else None
        return min(ready) if ready else None

    def _work_settled(self, rt: SessionRuntime) -> bool:
        """Nothing of the session runs, and (draining) nothing left can ever start.

        With nothing in flight and ingress closed, an item held back only by a
        full edge can never move: the edge empties only when its target runs,
        and nothing of this session is running or admissible. Items held by the
        output queue (a reader may poll) or by limits other sessions hold can.
        """
        if rt.in_flight:
            return False
        if rt.state is not State.DRAINING:
            return True
        for stage in self._scan_order:
            if self._candidate(rt, stage) is None:
                continue
            blocker = self._blocker(rt, stage)
            if blocker is None or not blocker.startswith("edge_capacity:"):
                return False
        return True

    def _blocker(self, rt: SessionRuntime, stage: Any) -> str | None:
        stage_id = stage.stage_id
        if rt.in_flight_by_stage[stage_id] >= stage.max_in_flight_per_session:
            return "stage_capacity"
        if self._in_flight_global[stage_id] >= stage.max_in_flight_global:
            return "global_capacity"
        group = stage.resource_group
        if group is not None and self._group_usage[group] >= self._group_limit[group]:
            return f"resource_group:{group}"
        for artifact in stage.produces:
            reserved = rt.producing[artifact]
            for target in self._targets.get(artifact, ()):
                if rt.occupancy[(artifact, target)] + reserved >= self._capacity[(artifact, target)]:
                    return f"edge_capacity:{artifact}->{target}"
            if artifact in self._outputs:
                held = len(rt.outputs) + sum(1 for v in rt.pending_outputs.values() if artifact in v)
                if held + reserved >= self.spec.output_capacity_per_session:
                    return f"output_capacity:{artifact}"
        return None

    def _try_admit(self, rt: SessionRuntime, stage: Any) -> bool:
        seq = self._candidate(rt, stage)
        if seq is None:
            return False
        stage_id = stage.stage_id
        blocker = self._blocker(rt, stage)
        if blocker is not None:
            rt.blockers[stage_id][seq] = blocker
            return False
        actor = self.actors[stage_id]
        if not actor.is_healthy():
            self._fail_actor_sessions(stage_id, actor.health().failure_reason)
            return False
        key = TaskKey(rt.session_id, rt.epoch, seq, stage_id, self._next_request)
        self._next_request += 1
        inputs = rt.take_inputs(stage_id, seq, stage.consumes)
        invocation = StageInvocation(key, inputs, is_first=seq == 0, is_last=seq == rt.final_sequence_id)
        try:
            actor.submit(invocation, self._on_done)
        except ActorBusyError:
            rt.restore_inputs(stage_id, seq, inputs)
            rt.blockers[stage_id][seq] = "actor_busy"
            return False
        except Exception as exc:
            rt.restore_inputs(stage_id, seq, inputs)
            if not actor.health().healthy:
                self._fail_actor_sessions(stage_id, actor.health().failure_reason, exc)
            else:
                self._fail(rt, exc)
            return False
        rt.in_flight[(stage_id, seq)] = key
        rt.in_flight_by_stage[stage_id] += 1
        rt.taken[stage_id].add(seq)
        for artifact in stage.produces:
            rt.producing[artifact] += 1
        self._in_flight_global[stage_id] += 1
        if stage.resource_group is not None:
            self._group_usage[stage.resource_group] += 1
        rt.timing(stage_id, seq).admitted_at = trio.current_time()
        self._dirty.update(self._upstream[stage_id])  # edge room freed upstream
        if stage.consumes & self.spec.ingress_artifacts:
            rt.wake_room()
        else:
            rt.wake_progress()
        return True

    # -- failure ---------------------------------------------------------------

    def _fail(self, rt: SessionRuntime, error: BaseException) -> None:
        """Fail one session: stop it, drop its buffers, clean it up in the background."""
        if rt.machine.can(Event.FAIL):
            first_failure = rt.state is not State.CANCELLING
            rt.machine.apply(Event.FAIL)
            rt.error = rt.error or error
            rt.close_reason = CloseReason.FAILED
            rt.discard_buffers()
            rt.outputs.clear()
            rt.wake()
            if first_failure:
                self._nursery.start_soon(self._background_cleanup, rt)

    def _fail_actor_sessions(
        self,
        stage_id: str,
        reason: str | None,
        error: BaseException | None = None,
        first: SessionRuntime | None = None,
    ) -> None:
        """An actor failure fails every session (the one that surfaced it keeps its own error)."""
        failure = ActorFailedError(f"stage actor {stage_id!r} is failed: {reason}")
        if error is not None:
            failure.__cause__ = error
        for rt in list(self._sessions.values()):
            if rt.starting_accepted_work:
                self._fail(rt, error if rt is first and error is not None else failure)

    async def _background_cleanup(self, rt: SessionRuntime) -> None:
        try:
            await self._shutdown(rt, CloseReason.FAILED, cancel=True, timeout=300.0)
        except SessionCleanupError:
            pass  # recorded on the session (poisoned); an explicit close retries

    async def _shutdown(self, rt: SessionRuntime, reason: CloseReason, *, cancel: bool, timeout: float, drain_timeout: float | None = None) -> None:
        await self._shutdowns.run(rt, reason, cancel=cancel, timeout=timeout, drain_timeout=drain_timeout)

    # -- whole orchestrator ----------------------------------------------------

    def diagnostics(self) -> Diagnostics:
        return Diagnostics(**attrs.asdict(self._counters))

    def resource_group_usage(self, name: str) -> int:
        if name not in self._group_usage:
            raise KeyError(f"unknown resource group {name!r}")
        return self._group_usage[name]

    def actor_health(self, stage_id: str) -> Any:
        if stage_id not in self.actors:
            raise KeyError(f"unknown stage {stage_id!r}")
        return self.actors[stage_id].health()

    def in_flight(self, stage_id: str) -> int:
        """Invocations of a stage running now, across sessions."""
        return self._in_flight_global[stage_id]

    async def barrier(self) -> None:
        """Wait until no session has work running or admissible, then until every actor is idle."""
        while any(rt.in_flight or (rt.starting_accepted_work and any(rt.ready.values())) for rt in self._sessions.values()):
            rt = next(rt for rt in self._sessions.values() if rt.in_flight or any(rt.ready.values()))
            await rt.changed.park()
        for actor in {id(a): a for a in (self.actors[s] for s in self.spec.topological_order)}.values():
            await actor.barrier()

    async def aclose(self, *, timeout: float = 300.0) -> None:
        """Shut every session down (reason shutdown), then close actors in reverse order (each actor once)."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        deadline = trio.current_time() + timeout
        errors: list[BaseException] = []

        async def shut(rt: SessionRuntime) -> None:
            try:
                await self._shutdown(rt, CloseReason.SHUTDOWN, cancel=True, timeout=max(0.0, deadline - trio.current_time()))
            except SessionCleanupError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for rt in list(self._sessions.values()):
                nursery.start_soon(shut, rt)
        closed: set[int] = set()
        for stage_id in reversed(self.spec.topological_order):
            if id(self.actors[stage_id]) in closed:
                continue  # an actor shared by several stages closes once
            closed.add(id(self.actors[stage_id]))
            with trio.move_on_at(deadline) as scope:
                try:
                    await self.actors[stage_id].aclose()
                except Exception as exc:
                    errors.append(exc)
            if scope.cancelled_caught:
                errors.append(TimeoutError(f"stage actor {stage_id!r} did not close in time"))
        self._closed.set()
        if errors:
            raise OrchestratorCloseError(
                f"failed to close {len(errors)} streaming stage actor(s) or session(s); first: {errors[0]!r}"
            ) from errors[0]


"""The trio streaming pipeline orchestrator: the public face of one scheduler core.

One orchestrator schedules every session of one pipeline. It starts the
stage actors, opens sessions on its :class:`~engine.core.SchedulerCore` (which
owns every runtime, reservation and counter), runs failed sessions' cleanup in
its nursery, and closes everything in order.

    async with open_orchestrator(spec, actors) as orch:
        async with orch.session("s1", final_sequence_id=9) as session:
            await session.push(0, {"image": img, "control": ctl})
            async for seq, artifacts in session.outputs():
                ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import trio

from states.pipeline_session import Event

from .actors import STAGE_ACTOR_METHODS, ActorHealth, StageActor
from .core import SchedulerCore
from .errors import (
    OrchestratorClosedError, OrchestratorCloseError, SessionCleanupError, UnknownSessionError, carries, seconds, shown,
)
from .graph import StageGraph
from .home_thread import HomeThread
from .ingress import as_sequence_id, check_final_sequence_id
from .metrics import Diagnostics
from .runtime import SessionRuntime
from .session import Session
from .shutdown import SessionShutdown
from .spec import PipelineSpec

__all__ = ["Orchestrator", "open_orchestrator"]

FAILED_CLEANUP_TIMEOUT = 300.0
# once the close deadline has passed (a stuck session or actor used it up), each actor still to close
# gets this long: a healthy one closes at once and is not reported as "did not close in time"
ACTOR_CLOSE_GRACE = 0.5
MAX_CLOSE_ERRORS_TOLD = 4  # a close error names this many failures (each session's and stage's), then "..."


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
    seconds("close_timeout", close_timeout, zero_ok=True)  # before anything starts: a bad one would hang the exit
    # the body's, a start's or a close's error, re-raised unwrapped (a Ctrl-C or sys.exit() in the body too: inside
    # the nursery it came out in a group, past ``except KeyboardInterrupt``, and sys.exit(3) exited 1)
    body_error: BaseException | None = None
    async with trio.open_nursery() as host:
        # The actors run shielded from whatever cancels the body (an app's shutdown): the sessions' ordered
        # shutdown below still runs every stage's hook through its live actor; then the actors are closed,
        # and only then is their nursery cancelled.
        # The start itself is shielded too (it returns at once): a cancel already pending when _host_actors calls
        # started() makes trio keep that task in start()'s own nursery, where, shielded and asleep, it would hold
        # this exit for ever. The pending cancel lands at the next checkpoint instead, after the hand-over.
        with trio.CancelScope(shield=True):
            actors_nursery, actors_scope = await host.start(_host_actors)
        orch = Orchestrator(spec, actors, actors_nursery)
        try:
            try:
                await orch.start_actors()
            except Exception as exc:  # e.g. an actor that already runs in another orchestrator
                body_error = exc
            else:
                try:
                    yield orch
                except BaseException as exc:  # re-raised below, outside the nursery, as itself
                    # (inside it any BaseException came out in a group, and a group of the body's in one more) but
                    # trio's cancellation, which its scopes must see as it goes, and a GeneratorExit, with which
                    # nothing may be awaited
                    if carries(exc, trio.Cancelled, GeneratorExit):
                        raise
                    body_error = exc
        finally:
            try:
                with trio.CancelScope(shield=True):
                    try:
                        await orch.aclose(timeout=close_timeout)
                    except OrchestratorCloseError as exc:
                        if body_error is None:
                            body_error = exc
            finally:  # whatever aclose raised: the actors' nursery sleeps until cancelled
                actors_scope.cancel(reason="the orchestrator closed its actors")
    if body_error is not None:
        raise body_error


async def _host_actors(task_status: trio.TaskStatus[tuple[trio.Nursery, trio.CancelScope]]) -> None:
    """The actors' nursery, under a shielded scope that only the orchestrator cancels (once it closed them)."""
    with trio.CancelScope(shield=True) as actors_scope:
        async with trio.open_nursery() as actors_nursery:
            task_status.started((actors_nursery, actors_scope))
            await trio.sleep_forever()


def check_actor_map(spec: PipelineSpec, actors: Mapping[str, StageActor]) -> None:
    """A spec, and exactly one actor per stage: a ValueError naming what is wrong, missing or unknown (before
    anything starts: a plain function given for an actor failed deep inside the start)."""
    if not isinstance(spec, PipelineSpec):
        raise ValueError(f"spec must be a PipelineSpec, got {type(spec).__name__}")
    if not isinstance(actors, Mapping):
        raise ValueError(f"actors must be a mapping of stage id to stage actor, got {type(actors).__name__}")
    for stage_id, actor in actors.items():
        missing_methods = [m for m in STAGE_ACTOR_METHODS if not callable(getattr(actor, m, None))]
        if missing_methods:
            raise ValueError(f"actors[{shown(stage_id)}] is a {type(actor).__name__}, not a stage actor (no "
                             f"{', '.join(missing_methods)}); wrap a handler in LocalStageActor")
    stage_ids = {s.stage_id for s in spec.stages}
    if set(actors) != stage_ids:
        missing = sorted(stage_ids - set(actors))
        extra = sorted(set(actors) - stage_ids)
        raise ValueError(f"actors must match the spec's stages exactly: missing {missing}, unknown {extra}")


class Orchestrator:
    """Schedules sessions across stage actors. Create it with :func:`open_orchestrator`."""

    def __init__(self, spec: PipelineSpec, actors: Mapping[str, StageActor], nursery: trio.Nursery) -> None:
        check_actor_map(spec, actors)
        self.spec = spec
        self.actors = dict(actors)
        self._nursery = nursery
        self._core = SchedulerCore(StageGraph.from_spec(spec), self.actors, self._start_failed_cleanup)
        self._shutdown = SessionShutdown(self._core)
        self._closing = False
        self._closed = trio.Event()
        # one close runs at a time; a close its caller cancelled leaves the rest to the next call
        self._close_lock = trio.Lock()
        self._started: dict[int, StageActor] = {}  # the actors this orchestrator started (it closes only those)
        self._home = HomeThread()  # made inside open_orchestrator's trio run: sessions are driven from it only

    async def start_actors(self) -> None:
        """Start each actor once, in topological order of its first stage.

        One actor object may serve several stages (e.g. decode co-located in the denoise
        worker group): it is started once and closed once; its failure is reported for each
        stage it serves, and its session hook runs once per stage.
        """
        for stage_id in self.spec.topological_order:
            actor = self.actors[stage_id]
            add_listener = getattr(actor, "add_failure_listener", None)
            if add_listener is not None:
                add_listener(self._core.on_actor_failed(stage_id))
            if id(actor) not in self._started:
                await self._nursery.start(actor.run)
                self._started[id(actor)] = actor

    # -- sessions ------------------------------------------------------------

    def _here(self, call: str) -> None:
        self._home.check("the orchestrator", call)

    def _open(self, session_id: str, final_sequence_id: int | None) -> SessionRuntime:
        if self._closing:
            raise OrchestratorClosedError("the orchestrator is closing; no new sessions")
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {shown(session_id)}")
        if final_sequence_id is not None:
            final_sequence_id = as_sequence_id(final_sequence_id)  # type: ignore[assignment]
            check_final_sequence_id(final_sequence_id)
        return self._core.open_session(session_id, final_sequence_id)

    def create_session(self, session_id: str, *, final_sequence_id: int | None = None) -> Session:
        """Open a session (a fresh epoch); a terminal session's id may be reused."""
        self._here("create_session")
        return Session(self._core, self._shutdown, self._open(session_id, final_sequence_id), self._home)

    @asynccontextmanager
    async def session(
        self, session_id: str, *, final_sequence_id: int | None = None, close_timeout: float = 60.0
    ) -> AsyncIterator[Session]:
        """A session that is drained and closed on exit (cancelled if the body raised)."""
        self._here("session")
        seconds("close_timeout", close_timeout, zero_ok=True)  # now, not at the exit the body reached
        rt = self._open(session_id, final_sequence_id)
        try:
            yield Session(self._core, self._shutdown, rt, self._home)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._shutdown.run(rt, Event.CANCEL, timeout=close_timeout)
            raise
        else:
            await self._shutdown.run(rt, Event.CLOSE, timeout=close_timeout)

    def get_session(self, session_id: str) -> Session:
        runtime = self._core.get(session_id)
        if runtime is None:
            raise UnknownSessionError(session_id)
        return Session(self._core, self._shutdown, runtime, self._home)

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Sessions that are live or poisoned (terminal ones are forgotten)."""
        return tuple(rt.session_id for rt in self._core.runtimes())

    def _start_failed_cleanup(self, rt: SessionRuntime) -> None:
        self._nursery.start_soon(self._failed_cleanup, rt)

    async def _failed_cleanup(self, rt: SessionRuntime) -> None:
        try:
            await self._shutdown.run(rt, None, timeout=FAILED_CLEANUP_TIMEOUT)
        except SessionCleanupError:
            pass  # recorded on the session (poisoned); an explicit close retries

    # -- whole orchestrator ----------------------------------------------------

    def diagnostics(self) -> Diagnostics:
        return self._core.diagnostics()

    def resource_group_usage(self, name: str) -> int:
        return self._core.resource_group_usage(name)

    def actor_health(self, stage_id: str) -> ActorHealth:
        if stage_id not in self.actors:
            raise KeyError(f"unknown stage {stage_id!r}")
        return self.actors[stage_id].health()

    def in_flight(self, stage_id: str) -> int:
        """Invocations of a stage running now, across sessions."""
        if stage_id not in self.actors:
            raise KeyError(f"unknown stage {stage_id!r}")
        return self._core.in_flight(stage_id)

    async def barrier(self) -> None:
        """Wait for graph quiescence: no session has work running or admissible, then every actor is idle.

        Ready work that backpressure holds (a full edge, an output nobody reads)
        is not admissible, so it does not keep the barrier waiting.
        """
        self._here("barrier")
        while True:
            busy = next((rt for rt in self._core.runtimes() if self._core.busy(rt)), None)
            if busy is None:
                break
            await self._core.wait_until(busy.changed, lambda rt=busy: not self._core.busy(rt))
        for actor in {id(a): a for a in (self.actors[s] for s in self.spec.topological_order)}.values():
            await actor.barrier()

    async def aclose(self, *, timeout: float = 300.0) -> None:
        """Shut every session down (reason shutdown), then close actors in reverse order (each actor once).

        Everything shares ``timeout``; an actor left to close after it passed still gets
        ``ACTOR_CLOSE_GRACE`` seconds, so only the ones that are really stuck are reported.
        """
        self._here("aclose")
        seconds("timeout", timeout, zero_ok=True)
        self._closing = True
        async with self._close_lock:  # a concurrent call waits for this one; after a cancelled one, it closes
            if not self._closed.is_set():
                await self._close(timeout)

    async def _close(self, timeout: float) -> None:
        deadline = trio.current_time() + timeout
        errors: list[BaseException] = []

        async def shut(rt: SessionRuntime) -> None:
            try:
                await self._shutdown.run(rt, Event.SHUT_DOWN, timeout=max(0.0, deadline - trio.current_time()))
            except SessionCleanupError as exc:
                errors.append(exc)

        async with trio.open_nursery() as sessions_nursery:
            for rt in self._core.runtimes():
                sessions_nursery.start_soon(shut, rt)
        closed: set[int] = set()
        for stage_id in reversed(self.spec.topological_order):
            if id(self.actors[stage_id]) in closed or id(self.actors[stage_id]) not in self._started:
                continue  # an actor shared by several stages closes once; one never started is not ours to close
            closed.add(id(self.actors[stage_id]))
            with trio.move_on_at(max(deadline, trio.current_time() + ACTOR_CLOSE_GRACE)) as actor_close_deadline:
                try:
                    await self.actors[stage_id].aclose()
                except Exception as exc:
                    errors.append(exc)
            if actor_close_deadline.cancelled_caught:
                errors.append(TimeoutError(f"stage actor {stage_id!r} did not close in time"))
        self._closed.set()
        if errors:
            raise OrchestratorCloseError(
                f"failed to close {len(errors)} streaming stage actor(s) or session(s): "
                + "; ".join(shown(error, limit=None) for error in errors[:MAX_CLOSE_ERRORS_TOLD])
                + ("; ..." if len(errors) > MAX_CLOSE_ERRORS_TOLD else "")
            ) from errors[0]

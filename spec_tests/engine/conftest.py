"""Shared builders for the orchestrator tests.

The canonical graph is the LingBot shape::

    image -> encode -> condition -+
                        control --+-> denoise -> latent -> decode -> frames

with capacity-2 edges, output capacity 2 and latency anchor ``control``.

:class:`Recorder` builds the stage handlers and session closers. Every handler
is ``async`` (it runs in its actor's task), logs ``(stage, session, seq)`` when
it starts and when it ends, and can be gated on a ``trio.Event`` or made to
raise for one ``(stage, seq)`` (optionally one session). Closers log
``(stage, session, reason)`` in the order the orchestrator releases stages.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import outcome
import pytest
import trio
import trio.testing

from engine import (
    ActorFailedError,
    ActorHealth,
    EdgeSpec,
    LocalStageActor,
    PipelineSpec,
    ResourceGroupSpec,
    Session,
    StageSpec,
    open_orchestrator,
)
from states.stage_actor import State as ActorState

STAGES = ("encode", "denoise", "decode")


def canonical_spec(
    *,
    capacity: int = 2,
    output_capacity: int = 2,
    anchor: str | None = "control",
    resource_groups: Iterable[ResourceGroupSpec] = (),
    **stage_overrides: dict[str, Any],
) -> PipelineSpec:
    """The 3-stage graph; ``encode=dict(max_in_flight_global=2)`` etc. override a stage."""

    def stage(stage_id: str, consumes: set[str], produces: set[str]) -> StageSpec:
        return StageSpec(stage_id, consumes, produces, **stage_overrides.get(stage_id, {}))

    return PipelineSpec(
        stages=[
            stage("encode", {"image"}, {"condition"}),
            stage("denoise", {"condition", "control"}, {"latent"}),
            stage("decode", {"latent"}, {"frames"}),
        ],
        edges=[
            EdgeSpec("image", "encode", None, capacity),
            EdgeSpec("condition", "denoise", "encode", capacity),
            EdgeSpec("control", "denoise", None, capacity),
            EdgeSpec("latent", "decode", "denoise", capacity),
        ],
        output_artifacts={"frames"},
        output_capacity_per_session=output_capacity,
        resource_groups=tuple(resource_groups),
        latency_anchor_artifact=anchor,
    )


def chunk(seq: int) -> dict[str, str]:
    """A full ingress batch for one sequence."""
    return {"image": f"image{seq}", "control": f"control{seq}"}


def value(artifact: str, session: str, seq: int) -> str:
    """What a recording handler returns for ``artifact``."""
    return f"{artifact}@{session}/{seq}"


Key = tuple[str, str | None, int]  # (stage, session or None for any, seq)


class Recorder:
    """Builds logging, gateable, failable handlers and closers for a spec's stages."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []  # handler entries, in order
        self.ends: list[tuple[str, str, int, str]] = []  # (stage, session, seq, "ok"|"raised"|"cancelled")
        self.invocations: list[Any] = []
        self.on_done: Callable[[Any, Any], None] | None = None  # the completion callback actors were given
        self.closes: list[tuple[str, str, Any]] = []  # (stage, session, reason)
        self.actor_closes: list[str] = []
        self.costs: dict[str, float] = {}  # stage -> virtual seconds per call
        self.outputs: dict[str, Callable[[Any], Any]] = {}  # stage -> replacement result builder
        self.close_hooks: dict[str, Callable[[Any, Any], None]] = {}
        self.closer_errors: dict[str, list[BaseException]] = defaultdict(list)  # raised once each
        self.hooks: list[Callable[[str, Any], None]] = []  # called at handler entry and exit
        self._gates: dict[Key, trio.Event] = {}
        self._failures: dict[Key, BaseException] = {}
        self._started: dict[tuple[str, str, int], trio.Event] = defaultdict(trio.Event)

    # -- configuration ------------------------------------------------------

    def gate(self, stage: str, seq: int, session: str | None = None) -> trio.Event:
        """The handler for (stage, seq) waits for the returned event once it has started."""
        event = self._gates[(stage, session, seq)] = trio.Event()
        return event

    def fail(self, stage: str, seq: int, error: BaseException, session: str | None = None) -> None:
        self._failures[(stage, session, seq)] = error

    def fail_close_once(self, stage: str, error: BaseException) -> None:
        self.closer_errors[stage].append(error)

    def release_all(self) -> None:
        for event in self._gates.values():
            event.set()

    def _lookup(self, table: dict[Key, Any], stage: str, session: str, seq: int) -> Any:
        return table.get((stage, session, seq), table.get((stage, None, seq)))

    async def wait_started(self, stage: str, session: str, seq: int) -> None:
        await self._started[(stage, session, seq)].wait()

    def started(self, stage: str, session: str, seq: int) -> bool:
        return (stage, session, seq) in self.calls

    # -- views --------------------------------------------------------------------

    def calls_of(self, stage: str, session: str | None = None) -> list[Any]:
        """Sequence ids (or (session, seq) when session is None) the stage started, in order."""
        if session is None:
            return [(s, q) for st, s, q in self.calls if st == stage]
        return [q for st, s, q in self.calls if st == stage and s == session]

    def closes_of(self, session: str) -> list[tuple[str, Any]]:
        return [(stage, reason) for stage, s, reason in self.closes if s == session]

    # -- builders ----------------------------------------------------------------

    def handler(self, stage: str, produces: Iterable[str]) -> Callable[[Any], Any]:
        produces = tuple(sorted(produces))

        async def handle(inv: Any) -> Any:
            key = inv.key
            entry = (stage, key.session_id, key.sequence_id)
            self.calls.append(entry)
            self.invocations.append(inv)
            self._started[entry].set()
            for hook in self.hooks:
                hook("enter", inv)
            status = "ok"
            try:
                gate = self._lookup(self._gates, *entry)
                if gate is not None:
                    await gate.wait()
                cost = self.costs.get(stage)
                if cost:
                    await trio.sleep(cost)  # bench-cost: the stage's configured work time (virtual under autojump)
                error = self._lookup(self._failures, *entry)
                if error is not None:
                    status = "raised"
                    raise error
                builder = self.outputs.get(stage)
                if builder is not None:
                    return builder(inv)
                return {a: value(a, key.session_id, key.sequence_id) for a in produces}
            except trio.Cancelled:
                status = "cancelled"
                raise
            finally:
                self.ends.append((*entry, status))
                for hook in self.hooks:
                    hook("exit", inv)

        return handle

    def closer(self, stage: str) -> Callable[[Any, Any], Any]:
        async def close(context: Any, reason: Any) -> None:
            self.closes.append((stage, context.session_id, reason))
            hook = self.close_hooks.get(stage)
            if hook is not None:
                hook(context, reason)
            pending = self.closer_errors.get(stage)
            if pending:
                raise pending.pop(0)

        return close

    def actors(self, spec: PipelineSpec, *, concurrent: Iterable[str] = (), mailbox: int = 1) -> dict[str, Any]:
        concurrent = set(concurrent)
        actors: dict[str, Any] = {}
        for stage in spec.stages:
            sid = stage.stage_id
            handler = self.handler(sid, stage.produces)
            if sid in concurrent:
                actors[sid] = ConcurrentActor(handler, name=sid, session_closer=self.closer(sid), recorder=self)
            else:
                actors[sid] = LoggedActor(
                    handler, name=sid, mailbox_capacity=mailbox, session_closer=self.closer(sid), recorder=self
                )
        return actors


class LoggedActor(LocalStageActor):
    """A LocalStageActor that logs when the orchestrator closes it."""

    def __init__(self, *args: Any, recorder: Recorder, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorder = recorder

    def submit(self, invocation: Any, on_done: Any) -> None:
        self._recorder.on_done = on_done
        super().submit(invocation, on_done)

    async def aclose(self) -> None:
        self._recorder.actor_closes.append(self.name)
        await super().aclose()


class ConcurrentActor:
    """A StageActor that runs every submitted invocation at once, each in its own task.

    Lets ``max_in_flight_*`` and resource-group limits be observed as real
    concurrency (a LocalStageActor runs one call at a time).
    """

    def __init__(self, handler: Callable[[Any], Any], *, name: str, session_closer: Any = None, recorder: Recorder | None = None) -> None:
        self.name = name
        self._handler = handler
        self._closer = session_closer
        self._recorder = recorder
        self._nursery: trio.Nursery | None = None
        self._stop = trio.Event()
        self._closed = False
        self.pending = 0
        self.running = 0
        self.max_running = 0
        self._idle = trio.lowlevel.ParkingLot()
        self.on_done_calls = 1  # how many times each result is reported (diagnostics tests)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self._stop.wait()

    def submit(self, invocation: Any, on_done: Any) -> None:
        if self._closed:
            raise ActorFailedError(f"{self.name} is closed")
        assert self._nursery is not None
        self.pending += 1
        self._nursery.start_soon(self._one, invocation, on_done)

    async def _one(self, invocation: Any, on_done: Any) -> None:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        with trio.CancelScope(shield=True):
            result = await outcome.acapture(self._handler, invocation)
        self.running -= 1
        self.pending -= 1
        for _ in range(self.on_done_calls):
            on_done(invocation, result)
        if not self.pending:
            self._idle.unpark_all()

    def health(self) -> ActorHealth:
        state = ActorState.CLOSED if self._closed else ActorState.RUNNING
        return ActorHealth(state, self.pending)

    def is_healthy(self) -> bool:
        return not self._closed

    async def close_session(self, context: Any, reason: Any) -> None:
        if self._closer is not None:
            await self._closer(context, reason)

    async def barrier(self) -> None:
        while self.pending:
            await self._idle.park()

    async def aclose(self) -> None:
        if self._recorder is not None:
            self._recorder.actor_closes.append(self.name)
        self._closed = True
        await self.barrier()
        self._stop.set()


@asynccontextmanager
async def running(
    rec: Recorder,
    spec: PipelineSpec | None = None,
    *,
    concurrent: Iterable[str] = (),
    mailbox: int = 1,
    close_timeout: float = 30.0,
) -> AsyncIterator[Any]:
    """Open an orchestrator over recording actors; every gate is released before it closes."""
    spec = spec or canonical_spec()
    actors = rec.actors(spec, concurrent=concurrent, mailbox=mailbox)
    async with open_orchestrator(spec, actors, close_timeout=close_timeout) as orch:
        try:
            yield orch
        finally:
            rec.release_all()


def check_capacity(session: Session, spec: PipelineSpec) -> dict[str, int]:
    """Assert every edge and the output queue are within capacity; return the levels seen."""
    levels = {}
    for edge in spec.edges:
        held = session.buffered(edge.artifact, edge.target_stage)
        assert held <= edge.capacity_per_session, f"{edge.describe()} holds {held}"
        levels[f"{edge.artifact}->{edge.target_stage}"] = held
    rt = session._runtime
    held_outputs = len(rt.outputs) + len(rt.pending_outputs)
    assert held_outputs <= spec.output_capacity_per_session, f"output holds {held_outputs}"
    levels["outputs"] = held_outputs
    return levels


async def settle() -> None:
    """Let every task run until all are blocked."""
    await trio.testing.wait_all_tasks_blocked()


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def spec() -> PipelineSpec:
    return canonical_spec()


@pytest.fixture
async def orch(rec: Recorder, spec: PipelineSpec) -> AsyncIterator[Any]:
    async with running(rec, spec) as orchestrator:
        yield orchestrator


# -- process worker groups (test_workers.py, test_hostile_workers.py) ---------------------------------

RANKS = "spec_tests.engine.worker_ranks"


def assert_no_children(pids: tuple[int, ...]) -> None:
    """No child process is left, and none of ``pids`` exists any more."""
    assert multiprocessing.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture
def groups() -> Iterator[Callable[..., Any]]:
    """Builds (unstarted) ProcessWorkerGroups and closes every one of them at teardown."""
    from engine.workers import ProcessWorkerGroup  # imported here: most engine tests never start a rank

    made: list[ProcessWorkerGroup] = []

    def make(factory: Any = f"{RANKS}:EchoRank", **kwargs: Any) -> ProcessWorkerGroup:
        kwargs.setdefault("close_timeout", 5.0)
        kwargs.setdefault("kill_grace", 0.5)
        made.append(ProcessWorkerGroup(factory, **kwargs))
        return made[-1]

    yield make
    for group in made:
        group.close()
    assert multiprocessing.active_children() == []

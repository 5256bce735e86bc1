"""Helpers of the stage actor tests: invocations, a completion recorder, thread gates, a started actor."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import outcome
import trio

from engine import EdgeSpec, LocalStageActor, PipelineSpec, StageSpec
from engine.actors import StageInvocation, TaskKey

GATE_TIMEOUT = 30.0  # a safety net so a broken test fails instead of hanging

#: two stages, control -> dynamics -> latent -> render -> frames: the pipeline author's smallest graph
SPEC = PipelineSpec(
    stages=[StageSpec("dynamics", {"control"}, {"latent"}), StageSpec("render", {"latent"}, {"frames"})],
    edges=[EdgeSpec("control", "dynamics", None, 2), EdgeSpec("latent", "render", "dynamics", 2)],
    output_artifacts={"frames"},
)


def render(invocation: StageInvocation) -> dict[str, Any]:
    return {"frames": invocation.inputs["latent"]}


async def join_thread(actor: LocalStageActor) -> None:
    """Wait (on a worker thread) until the actor's own OS thread has ended."""
    thread = next((t for t in threading.enumerate() if t.ident == actor.thread_ident), None)
    if thread is not None:
        await trio.to_thread.run_sync(thread.join)


def make_invocation(
    session_id: str = "s1", sequence_id: int = 0, *, stage_id: str = "encode", epoch: int = 1, request_id: int = 0
) -> StageInvocation:
    key = TaskKey(session_id, epoch, sequence_id, stage_id, request_id)
    return StageInvocation(key, {"x": sequence_id}, is_first=sequence_id == 0, is_last=False)


class Completions:
    """The ``on_done`` callback: records every resolution and lets trio wait for one."""

    def __init__(self) -> None:
        self.results: dict[TaskKey, outcome.Outcome] = {}
        self.order: list[TaskKey] = []
        self.callback_threads: set[int] = set()
        self._events: dict[TaskKey, trio.Event] = {}
        self.log: list[tuple] | None = None

    def _event(self, key: TaskKey) -> trio.Event:
        return self._events.setdefault(key, trio.Event())

    def __call__(self, invocation: StageInvocation, result: outcome.Outcome) -> None:
        assert invocation.key not in self.results, "an invocation resolved twice"
        self.results[invocation.key] = result
        self.order.append(invocation.key)
        self.callback_threads.add(threading.get_ident())
        if self.log is not None:
            self.log.append(("done", invocation.key.session_id, invocation.key.sequence_id))
        self._event(invocation.key).set()

    async def wait(self, invocation: StageInvocation) -> outcome.Outcome:
        await self._event(invocation.key).wait()
        return self.results[invocation.key]


class Gates:
    """Per-sequence ``threading.Event`` gates a synchronous handler waits at."""

    def __init__(self) -> None:
        self._gates: dict[tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()
        self._all_open = False

    def _gate(self, key: tuple[str, int]) -> threading.Event:
        with self._lock:
            gate = self._gates.setdefault(key, threading.Event())
            if self._all_open:
                gate.set()
            return gate

    def wait(self, invocation: StageInvocation) -> None:
        key = (invocation.key.session_id, invocation.key.sequence_id)
        if not self._gate(key).wait(GATE_TIMEOUT):
            raise TimeoutError(f"gate {key} never opened")

    def open(self, session_id: str, sequence_id: int) -> None:
        self._gate((session_id, sequence_id)).set()

    def open_all(self) -> None:
        """Open every gate, including those a handler has not reached yet."""
        with self._lock:
            self._all_open = True
            gates = list(self._gates.values())
        for gate in gates:
            gate.set()


@asynccontextmanager
async def started(actor: Any, nursery: trio.Nursery) -> AsyncIterator[Any]:
    await nursery.start(actor.run)
    try:
        yield actor
    finally:
        await actor.aclose()


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}

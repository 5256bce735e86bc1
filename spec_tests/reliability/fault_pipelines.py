"""Small pipelines built on the engine, with faults on request, for the reliability tests.

:class:`EngineService` is a :class:`~pipelines.contract.BidirectionalService` over a real
orchestrator with two stages, like the seeds' graph without the encoder::

    denoise (control -> latent)   the "model": by default a LocalStageActor, or any actor given
    decode  (latent -> frames)    flat grey frames whose level is the chunk index

Faults:

- ``raise_on_chunk=n``: the denoise handler raises :class:`StageExploded` for chunk ``n``;
- ``closer_failures=k``: the decode stage's session hook raises :class:`HookExploded` the first
  ``k`` times it runs (the pipeline session is then POISONED; a retry runs only that hook again);
- ``denoise_actor=...``: e.g. :func:`process_denoise_actor`, a ParallelWorkerStageActor owning a
  :class:`~engine.workers.ProcessWorkerGroup` whose rank holds chunks from ``hold_from`` on (so a
  chunk is in flight in the child when the test kills it).

``threaded=True`` runs the handlers on the actors' dedicated threads (as real models do);
``threaded=False`` makes them async, so the service has no threads (autojump-friendly).

When the pipeline session fails, :meth:`chunks` raises :class:`PipelineSessionFailed` naming the
engine's error, so the room runner records a failed session with that reason. ``close_session``
cancels the engine session and lets :class:`~engine.SessionCleanupError` propagate (the runner then
fails the server session: "closing the pipeline session failed: ..."); the handles stay in
``handles`` so a test can retry the cleanup through the orchestrator.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio

from engine import (
    EdgeSpec,
    LocalStageActor,
    ParallelWorkerStageActor,
    PipelineSpec,
    StageSpec,
    open_orchestrator,
)
from engine.workers import ProcessWorkerGroup
from pipelines.contract import (
    BidirectionalService,
    Chunk,
    Control,
    ControlRejected,
    ControlType,
    SessionConfig,
)
from states.pipeline_session import State as PipelineState

__all__ = [
    "SPEC",
    "EngineService",
    "HookExploded",
    "PipelineSessionFailed",
    "StageExploded",
    "process_denoise_actor",
]

SPEC = PipelineSpec(
    stages=(
        StageSpec("denoise", {"control"}, {"latent"}),
        StageSpec("decode", {"latent"}, {"frames"}),
    ),
    edges=(
        EdgeSpec("control", "denoise", None, 2),
        EdgeSpec("latent", "decode", "denoise", 2),
    ),
    output_artifacts={"frames"},
    output_capacity_per_session=2,
)

TERMINAL = frozenset({PipelineState.CLOSED, PipelineState.CANCELLED, PipelineState.FAILED})
RANK_FACTORY = "spec_tests.engine.worker_ranks:EchoRank"  # light to import in a spawned child


class StageExploded(RuntimeError):
    """The fault a stage handler raises."""


class HookExploded(RuntimeError):
    """The fault a stage's session-cleanup hook raises."""


class PipelineSessionFailed(RuntimeError):
    """The engine failed the pipeline session (raised from ``chunks`` to the room runner)."""


def process_denoise_actor(*, hold_from: int, close_timeout: float = 5.0) -> ParallelWorkerStageActor:
    """A denoise stage run by one spawned rank; chunks ``>= hold_from`` never return (until killed)."""
    group = ProcessWorkerGroup(RANK_FACTORY, name="denoise-ranks", close_timeout=close_timeout, kill_grace=0.5)
    return ParallelWorkerStageActor(
        group,
        "step",
        input_builder=lambda inv: ((inv.key.sequence_id,), {"hold": inv.key.sequence_id >= hold_from}),
        output_builder=lambda result, inv: {"latent": result},
        name="denoise",
    )


class EngineService(BidirectionalService):
    def __init__(
        self,
        *,
        threaded: bool = True,
        raise_on_chunk: int | None = None,
        closer_failures: int = 0,
        denoise_actor: Callable[[], Any] | None = None,
        fps: float = 50.0,
        frames_per_chunk: int = 2,
        size: tuple[int, int] = (16, 16),
    ) -> None:
        self.threaded = threaded
        self.raise_on_chunk = raise_on_chunk
        self.closer_failures = closer_failures
        self.closer_calls: list[tuple[str, str]] = []  # (session, reason) per hook run, failed or not
        self._make_denoise = denoise_actor
        self.fps = fps
        self.frames_per_chunk = frames_per_chunk
        self.size = size
        self.orch: Any = None
        self.actors: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}  # pipeline session id -> engine.Session (kept after the end)
        self.stopping: set[str] = set()
        self.chunks_made: dict[str, int] = {}
        self._ids = itertools.count(1)

    # -- stages ------------------------------------------------------------------------

    def _denoise_sync(self, invocation: Any) -> dict[str, Any]:
        seq = invocation.key.sequence_id
        if seq == self.raise_on_chunk:
            raise StageExploded(f"denoise exploded on chunk {seq}")
        return {"latent": seq}

    async def _denoise_async(self, invocation: Any) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return self._denoise_sync(invocation)

    def _decode_sync(self, invocation: Any) -> dict[str, Any]:
        level = 20 + (int(invocation.inputs["latent"]) * 40) % 220
        height, width = self.size
        return {"frames": np.full((self.frames_per_chunk, height, width, 3), level, dtype=np.uint8)}

    async def _decode_async(self, invocation: Any) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return self._decode_sync(invocation)

    def _hook_sync(self, context: Any, reason: Any) -> None:
        self.closer_calls.append((context.session_id, reason.value))
        if self.closer_failures > 0:
            self.closer_failures -= 1
            raise HookExploded(f"decode could not release session {context.session_id!r}")

    async def _hook_async(self, context: Any, reason: Any) -> None:
        await trio.lowlevel.checkpoint()
        self._hook_sync(context, reason)

    def _build_actors(self) -> dict[str, Any]:
        if self._make_denoise is not None:
            denoise = self._make_denoise()
        else:
            handler = self._denoise_sync if self.threaded else self._denoise_async
            denoise = LocalStageActor(handler, name="denoise")
        decode = LocalStageActor(
            self._decode_sync if self.threaded else self._decode_async,
            name="decode",
            session_closer=self._hook_sync if self.threaded else self._hook_async,
        )
        return {"denoise": denoise, "decode": decode}

    # -- the contract --------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[EngineService]:
        self.actors = self._build_actors()
        group = getattr(self.actors["denoise"], "worker", None)
        try:
            if isinstance(group, ProcessWorkerGroup):
                await trio.to_thread.run_sync(group.start, 60.0)
            async with open_orchestrator(SPEC, self.actors, close_timeout=30.0) as orch:
                self.orch = orch
                try:
                    yield self
                finally:
                    self.orch = None
        finally:
            if isinstance(group, ProcessWorkerGroup) and not group.closed:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(group.close)

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        if self.orch is None:
            raise RuntimeError("create_session needs `async with service.running():`")
        session_id = f"eng-{next(self._ids)}"
        self.handles[session_id] = self.orch.create_session(session_id)
        self.chunks_made[session_id] = 0
        return session_id

    async def push_control(self, session_id: str, control: Control) -> None:
        handle = self.handles.get(session_id)
        if handle is None or handle.status is not PipelineState.RUNNING:
            raise ControlRejected(f"session {session_id!r} is not running")
        if control.type is ControlType.STOP:
            self.stopping.add(session_id)

    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        return _EngineChunks(self, session_id)

    async def close_session(self, session_id: str) -> None:
        """Cancel the engine session; a poisoned cleanup raises SessionCleanupError (retried by calling again)."""
        handle = self.handles.get(session_id)
        if handle is None or handle.status in TERMINAL:
            return
        self.stopping.add(session_id)
        await handle.cancel(timeout=20.0)


class _EngineChunks:
    """One chunk per control pushed: push sequence ``n``, then wait for its frames."""

    def __init__(self, service: EngineService, session_id: str) -> None:
        self._service = service
        self._session_id = session_id
        self._handle = service.handles[session_id]
        self._index = 0
        self._closed = False

    def __aiter__(self) -> _EngineChunks:
        return self

    async def __anext__(self) -> Chunk:
        service, handle, seq = self._service, self._handle, self._index
        if self._closed or self._session_id in service.stopping:
            raise StopAsyncIteration
        if handle.status is PipelineState.RUNNING:
            with contextlib.suppress(Exception):  # refused because the session failed meanwhile: see below
                await handle.push(seq, {"control": seq})
        async with contextlib.aclosing(handle.outputs()) as outputs:
            async for got, artifacts in outputs:
                self._index = got + 1
                service.chunks_made[self._session_id] += 1
                return Chunk(index=got, frames=artifacts["frames"], fps=service.fps, metadata={"sequence": got})
        if handle.error is not None:
            error = handle.error
            raise PipelineSessionFailed(
                f"pipeline session {self._session_id} failed: {type(error).__name__}: {error}"
            ) from error
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._closed = True

"""The toy world as a BidirectionalService: three engine stages, the prefetch window and the lease.

Stages (the seeds' LingBot graph), one actor each, shared by every session:

    encode  (encode_request -> condition)   the reference image and prompt to a latent world,
                                            once per session (and again after a new prompt)
    denoise (condition + control -> latent) integrate the pose from the held keys frame by
                                            frame, warp the world, refine with the session cache
    decode  (latent -> frames)              latents to RGB frames

Ownership: the denoise actor owns each session's slot (world latent, latent
cache, pose) and releases it in its session hook; encode and decode hold no
per-session state. The service only routes: it keeps each session's control
state, drives one chunk at a time under the execution lease, and turns outputs
into :class:`Chunk` s.

When chunks are made: in the default ``on_input`` mode a chunk is requested
only while a key is held (or a short press, a pose reset or a new prompt is
pending), after the previous chunk's denoise finished; with nothing held no
chunk is made and the last frame stays on screen. Session creation makes one
preview chunk. ``continuous`` mode (offline runs) makes chunks back to back;
``chunks`` ends the session after that many, ``resolution`` sizes its frames, and any other option is
refused with a ``ValueError`` naming it;
scripted controls (``SessionConfig.timeline``) apply to the first chunk that
starts at or after their time on the media clock.

Placement (:mod:`.placement`, :mod:`.stages`): in-process (default) or process worker groups;
identical chunks for a seed and controls either way. A dead worker fails its group, its actor and
every session of this service (all use every stage); the service does **not** restart groups, it
fails as a whole: :attr:`ToyWorldService.failure` names the stage, failed sessions' ``chunks()``
raise :class:`PipelineFailed`, ``create_session`` raises :class:`ServiceFailedError`, and ``running()``
is left at once (its body is cancelled) with :class:`ServiceFailedError`, so that its owner notices
and replaces the instance (other instances are unaffected).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
import trio

from engine import (
    SessionCleanupError,
    SessionMemoryBudget,
    SessionStateError,
    open_orchestrator,
)
from states.lease_book import LeaseTransition
from states.pipeline_session import ADMITTING, ENDED_FAILED

from pipelines.contract import (
    BidirectionalService,
    Chunk,
    Control,
    ControlRejected,
    ControlType,
    EventSink,
    MemoryReport,
    ServiceEvent,
    SessionConfig,
)
from pipelines.images import load_image_sized
from pipelines.lease import EVENT_NAMES, ExecutionLease, LeaseClosed
from pipelines.prefetch import ConditionPrefetch, ControlOrderError
from .model import SessionSlots, ToyWorldConfig, ToyWorldModel, chunk_noise_seed
from .placement import DTYPES, Placement, load_placement, pipeline_spec
from .session_state import ToySession as _ToySession, check_image_size, session_options
from .stages import ChunkControl, Condition, EncodeRequest, make_stages

__all__ = [
    "SPEC", "ChunkControl", "Condition", "EncodeRequest", "PipelineFailed", "ServiceFailedError", "ToyWorldService",
]

class PipelineFailed(RuntimeError):
    """A stage failed the session; the chunk stream ends with this error."""


class ServiceFailedError(RuntimeError):
    """A stage's workers died: the service refuses new sessions (replace the service instance)."""


SPEC = pipeline_spec(Placement.uniform())  # the graph (no resource group unless a placement declares one)

# A session never has more than this many chunks requested but not yet read by
# its consumer, so a slow reader holds back only its own session (never the lease).
UNDELIVERED_LIMIT = 2


class ToyWorldService(BidirectionalService):
    """A small real world model served through the engine, many sessions per instance."""

    supports_timeline = True

    def __init__(
        self,
        config: ToyWorldConfig | None = None,
        *,
        max_sessions: int = 4,
        control_idle_timeout: float = 10.0,
        rotate_lease: bool = False,
        placement: Placement | Mapping[str, Any] | str | None = None,
    ) -> None:
        """``control_idle_timeout``: seconds without a control after which a session's claim on the
        lease is idle (the server's ``--control-idle-timeout``); ``rotate_lease``: opt in to active
        sessions taking turns chunk by chunk (the default is the seed's rule: hand over when idle)."""
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.config = config or ToyWorldConfig()
        dtype = next((name for name, value in DTYPES.items() if value == self.config.dtype), "float32")
        self.placement = (
            Placement.uniform(self.config.device, dtype) if placement is None else load_placement(placement)
        )
        self.max_sessions = max_sessions
        self.control_idle_timeout = control_idle_timeout
        self._sessions: dict[str, _ToySession] = {}
        self._slot_of: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._model: ToyWorldModel | None = None  # in-process placement only (denoise's model)
        self._slots: SessionSlots | None = None  # in-process placement only
        self._stages: Any = None
        self._orch: Any = None
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._lease = ExecutionLease(control_idle_timeout, rotate=rotate_lease, on_transition=self._on_lease_transition)
        self._snapshots: tuple[Any, ...] = ()

    # -- lifecycle ---------------------------------------------------------------

    @property
    def lease_idle_timeout(self) -> float:
        """The idle timeout the execution lease applies (what ``control_idle_timeout`` became)."""
        return self._lease.book.idle_timeout

    @property
    def failure(self) -> str | None:
        """Why the service failed (a stage's workers died), or None."""
        return None if self._stages is None else self._stages.failure

    def configure_session_capacity(self, limit: int) -> None:
        if self._stages is not None:
            raise RuntimeError("configure_session_capacity must be called before running()")
        if limit < 1:
            raise ValueError(f"session capacity must be >= 1, got {limit}")
        self.max_sessions = limit

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ToyWorldService]:
        """Build the stages for the placement, start their actors and the lease."""
        torch.set_num_threads(1)  # stages run in parallel threads (one intra-op thread each)
        self._token = trio.lowlevel.current_trio_token()
        stages = make_stages(self.config, self.max_sessions, self.placement, self._notify_denoised)
        actors = await stages.start({"encode": self._encode, "denoise": self._denoise, "decode": self._decode})
        self._stages = stages
        self._slot_of = stages.slot_of
        if self.placement.mode == "in-process":
            self._model, self._slots = stages.models["denoise"], stages.slots
        try:
            async with open_orchestrator(pipeline_spec(self.placement), actors) as orch, trio.open_nursery() as nursery:
                self._orch, self._nursery = orch, nursery
                nursery.start_soon(self._lease.run)
                await self._warm_up()
                # a stage that fails as a whole ends the block: the owner hears it now, not at its next call
                with trio.CancelScope() as body:
                    nursery.start_soon(self._leave_on_failure, stages, body)
                    try:
                        yield self
                    finally:
                        with trio.CancelScope(shield=True):
                            for session_id in list(self._sessions):
                                await self.close_session(session_id)
                        nursery.cancel_scope.cancel()
        finally:
            self._orch = self._nursery = None
            with trio.CancelScope(shield=True):
                await stages.aclose()
        if stages.failure is not None:
            raise ServiceFailedError(f"the toy world service failed: {stages.failure}")

    @staticmethod
    async def _leave_on_failure(stages: Any, body: trio.CancelScope) -> None:
        await stages.failed.wait()
        body.cancel(reason=f"the toy world service failed: {stages.failure}")

    async def _warm_up(self) -> None:
        """One chunk through every stage so that memory snapshots see steady-state peaks."""
        session_id = await self.create_session(SessionConfig())  # every session makes one chunk
        async with contextlib.aclosing(self.chunks(session_id)) as chunks:
            async for _ in chunks:
                break
        await self.close_session(session_id)
        self._snapshots = await trio.to_thread.run_sync(self._stages.memory_snapshots)

    def memory_report(self) -> MemoryReport | None:
        if self._stages is None or not self._snapshots:
            return None
        budget = SessionMemoryBudget(persistent_bytes_per_session=self._stages.bytes_per_session)
        return MemoryReport(snapshots=self._snapshots, role_budgets={"toy_world": budget})

    # -- sessions ----------------------------------------------------------------

    async def create_session(self, config: SessionConfig, *, on_event: EventSink | None = None) -> str:
        if self._orch is None or self._stages is None or self._nursery is None:
            raise RuntimeError("create_session needs `async with service.running():`")
        if self._stages.failure is not None:
            raise ServiceFailedError(f"the toy world service failed and takes no new sessions: {self._stages.failure}")
        continuous, chunk_count, resolution = session_options(config.options, self.config)
        image = None
        if config.image_path:
            image, info = await trio.to_thread.run_sync(load_image_sized, config.image_path, self.config.world_size)
            # the check the server ran on the create's image (check_image), on the file's own size: the pixels
            # read are scaled down to the world's size, and a 1000 x 1 image was said to be 320 x 1
            check_image_size(info.width, info.height, self.config,
                             name=f"image {Path(str(config.image_path)).name!r}")
        slot = self._stages.pool.acquire()  # SlotPoolFullError when every retained slot is taken
        session_id = f"toy-{next(self._ids)}"
        self._slot_of[session_id] = slot
        orch_session = self._orch.create_session(
            session_id, final_sequence_id=None if chunk_count is None else chunk_count - 1
        )
        send, receive = trio.open_memory_channel[Chunk](UNDELIVERED_LIMIT)
        session = _ToySession(
            session_id=session_id,
            slot=slot,
            orch=orch_session,
            prefetch=None,  # type: ignore[arg-type]
            config=config,
            image=image,
            continuous=continuous,
            chunk_count=chunk_count,
            on_event=on_event,
            send_chunk=send,
            receive_chunk=receive,
            prompt=config.prompt,
            resolution=resolution,
            timeline=sorted(config.timeline, key=lambda item: item[0]),
        )
        session.prefetch = ConditionPrefetch(
            orch_session, make_condition=lambda index: self._encode_request(session, index), chunk_count=chunk_count
        )
        self._sessions[session_id] = session
        self._lease.register(session_id)
        self._lease.record_activity(session_id)  # pressing Start asks for the preview chunk
        session.prefetch.prime()
        self._nursery.start_soon(self._run_session, session)
        return session_id

    async def check_options(self, options: Mapping[str, Any]) -> None:
        """The check :meth:`create_session` runs on a session's options (``ValueError`` naming the option)."""
        session_options(options, self.config)

    async def check_image(self, width: int, height: int) -> None:
        """The check :meth:`create_session` runs on a session's image (its 2 x 2 minimum)."""
        check_image_size(width, height, self.config)

    def _encode_request(self, session: _ToySession, index: int) -> EncodeRequest:
        needs_world = index == 0
        return EncodeRequest(index, session.image if needs_world else None, needs_world, session.slot)

    def _session(self, session_id: str) -> _ToySession:
        session = self._sessions.get(session_id)
        if session is None:
            raise ControlRejected(f"unknown session {session_id!r}")
        return session

    async def push_control(self, session_id: str, control: Control) -> None:
        session = self._session(session_id)
        if session.stopping:
            raise ControlRejected("the session is stopping")
        self._apply_control(session, control)
        if control.type is not ControlType.STOP:
            self._lease.record_activity(session_id)
        session.wake()

    @staticmethod
    def _apply_control(session: _ToySession, control: Control) -> None:
        kind = control.type
        if kind is ControlType.CONTROL_STATE:
            session.held = set(control.keys)
        elif kind is ControlType.CONTROL:
            assert control.key is not None
            if control.pressed:
                session.held.add(control.key)
                session.pressed.add(control.key)
            else:
                session.held.discard(control.key)
        elif kind is ControlType.RESET:
            session.held.clear()
            session.pressed.clear()
        elif kind is ControlType.RESET_POSE:
            session.reset_pose_pending = True
        elif kind is ControlType.PROMPT:
            session.prompt = control.prompt
            session.new_prompt_pending = True
        elif kind is ControlType.STOP:
            session.stopping = True

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"unknown session {session_id!r}")
        async with session.receive_chunk.clone() as receive:
            async for chunk in receive:
                session.delivered += 1
                session.wake()
                yield chunk
        if session.error is not None:
            raise PipelineFailed(f"session {session_id} failed: {session.error}") from session.error

    async def close_session(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is None:
            return
        session.stopping = True
        session.scope.cancel(reason=f"session {session_id} is closing")
        await session.finished.wait()
        self._lease.close(session_id)
        try:
            await session.orch.cancel()
        except SessionCleanupError:
            return  # poisoned: the record stays, so that closing it again retries the cleanup
        self._sessions.pop(session_id, None)

    # -- per-session driving (trio) ----------------------------------------------

    async def _run_session(self, session: _ToySession) -> None:
        try:
            with session.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_outputs, session, nursery.cancel_scope)
                    await self._drive(session)
                    if session.last_index is None or session.forwarded >= session.last_index:
                        nursery.cancel_scope.cancel()
        finally:
            session.send_chunk.close()
            session.finished.set()

    async def _drive(self, session: _ToySession) -> None:
        index = 0
        try:
            while session.chunk_count is None or index < session.chunk_count:
                control = await self._next_control(session, index)
                if control is None:
                    break
                async with self._lease.chunk(session.session_id):
                    await session.prefetch.submit(index, control)
                    session.submitted = index + 1
                    done = session.denoised.setdefault(index, trio.Event())
                    await done.wait()
                session.denoised.pop(index, None)
                index += 1
        except (LeaseClosed, ControlOrderError, SessionStateError):
            pass  # the session is closing: nothing more to request
        finally:
            session.last_index = index - 1

    def _media_time(self, index: int) -> float:
        return index * self.config.frames_per_chunk / self.config.fps

    async def _next_control(self, session: _ToySession, index: int) -> ChunkControl | None:
        """Wait until the session asks for chunk ``index`` (and its reader has room)."""
        while True:
            if session.stopping:
                return None
            while session.timeline and session.timeline[0][0] <= self._media_time(index) + 1e-9:
                _, scripted = session.timeline.pop(0)
                self._apply_control(session, scripted)
            room = index - session.delivered < UNDELIVERED_LIMIT
            wanted = (
                index == 0
                or session.continuous
                or session.held
                or session.pressed
                or session.reset_pose_pending
                or session.new_prompt_pending
            )
            if room and wanted:
                control = ChunkControl(
                    index=index,
                    slot=session.slot,
                    keys=frozenset(session.held | session.pressed),
                    reset_pose=session.reset_pose_pending,
                    noise_seed=chunk_noise_seed(self.config.seed, index),
                    prompt=session.prompt,
                    resolution=session.resolution,
                )
                session.pressed.clear()
                session.reset_pose_pending = False
                session.new_prompt_pending = False
                return control
            if not wanted:
                self._lease.idle(session.session_id)  # nothing to run: step aside for whoever waits
            await session.changed.park()

    async def _read_outputs(self, session: _ToySession, scope: trio.CancelScope) -> None:
        async with contextlib.aclosing(session.orch.outputs()) as outputs:
            await self._forward(session, outputs, scope)

    async def _forward(self, session: _ToySession, outputs: AsyncIterator[Any], scope: trio.CancelScope) -> None:
        await self._forward_chunks(session, outputs, scope)
        if session.orch.status in ENDED_FAILED or session.orch.error is not None:
            # a stage failed: end the session's stream with that error instead of waiting forever
            session.error = session.orch.error or RuntimeError("the pipeline session failed")
            session.scope.cancel()

    async def _forward_chunks(self, session: _ToySession, outputs: AsyncIterator[Any], scope: trio.CancelScope) -> None:
        async for seq, artifacts in outputs:
            frames, control, poses = artifacts["frames"]
            chunk = Chunk(
                index=seq,
                frames=frames,
                fps=self.config.fps,
                applied_controls={
                    "keys": sorted(control.keys),
                    "prompt": control.prompt,
                    "reset_pose": control.reset_pose,
                    "pose": list(poses[-1].as_tuple()),
                },
                metadata=self._chunk_metadata(session, seq),
            )
            await session.send_chunk.send(chunk)
            session.forwarded = seq
            if session.last_index is not None and seq >= session.last_index:
                scope.cancel()
                return

    def _chunk_metadata(self, session: _ToySession, seq: int) -> dict[str, Any]:
        """Per-chunk timings, from O(1) lookups (a long session must not make each chunk slower)."""
        orch = session.orch
        stage_times = {}
        for stage in ("encode", "denoise", "decode"):
            timing = orch.stage_timing(stage, seq)
            if timing is not None and timing.admitted_at is not None and timing.completed_at is not None:
                stage_times[stage] = timing.completed_at - timing.admitted_at
        idle_reasons = {}
        for stage in ("denoise", "decode"):
            interval = orch.idle_before(stage, seq)
            if interval is not None:
                idle_reasons[stage] = interval.reason
        metadata: dict[str, Any] = {"stage_times": stage_times, "idle_reasons": idle_reasons}
        latency = orch.control_to_output(seq)
        if latency is not None:
            metadata["control_to_output_seconds"] = latency
        return metadata

    # -- lease events ------------------------------------------------------------

    def _on_lease_transition(self, transition: LeaseTransition) -> None:
        name = EVENT_NAMES.get(transition.state)
        session = self._sessions.get(transition.session_id)
        if name is None or session is None or session.on_event is None:
            return
        position = self._lease.book.queue_position(transition.session_id) if transition.session_id in self._lease.book else None
        session.on_event(ServiceEvent(transition.session_id, name, {"queue_position": position}))

    # -- stage handlers (in-process placement; on each actor's thread) and notifications ---

    def _encode(self, invocation: Any) -> Mapping[str, Any]:
        return self._stages.encode(invocation)

    def _denoise(self, invocation: Any) -> Mapping[str, Any]:
        return self._stages.denoise(invocation)

    def _decode(self, invocation: Any) -> Mapping[str, Any]:
        return self._stages.decode(invocation)

    def _notify_denoised(self, session_id: str, index: int) -> None:
        """Called on a stage thread when a chunk's denoise finished."""
        assert self._token is not None
        self._token.run_sync_soon(self._on_denoised, session_id, index)

    def _on_denoised(self, session_id: str, index: int) -> None:
        """Runs in the trio thread (via run_sync_soon), so it must never raise."""
        session = self._sessions.get(session_id)
        if session is None:
            return
        session.denoised.setdefault(index, trio.Event()).set()
        if session.orch.status in ADMITTING and not session.stopping:
            session.prefetch.refill()  # normally admits condition[index + 2]

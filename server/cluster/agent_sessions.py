"""The sessions one worker agent runs: their room runners, their records, their uploaded images.

The agent's connection (:mod:`server.cluster.agent`) hands each Start and Stop here; this
side makes a :class:`~server.runner.RoomRunner` for the session on the agent's model worker,
mirrors its record, and sends every table event and the finish back through the one ``send``
the connection gives it (in order, with a per-session sequence number the authority checks), and who is
in each room as that changes (:meth:`AgentSessions.report_participants`, bounded in rate).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import trio

from states.stream_session import DrainCause, Event, State, StreamSessionMachine

from ..lifecycle import SessionLifecycle
from ..metrics import ServerMetrics
from ..model_worker import ModelWorker
from ..reasons import echo
from ..registry import SessionRecord, SessionRegistry
from ..runner import RoomRunner, RunnerDeps
from ..server_folders import ServerFolder
from . import wire
from .rooms import RemoteRooms
from .wire_values import MAX_PARTICIPANTS

__all__ = ["AgentSessions", "RUNNER_STOP_GRACE", "PARTICIPANTS_EVERY"]

RUNNER_STOP_GRACE = 10.0  # how long fenced or drained runners may take to finish their cleanup
#: seconds between two participants reports of one agent: a room whose people come and go faster is reported as
#: it stands after each pause (at most one message a session each time)
PARTICIPANTS_EVERY = 0.5

_IMAGE_SUFFIX = re.compile(r"\.[A-Za-z0-9]{1,10}")


class _MintedTokens:
    """The runner asks for a worker token; the authority minted it (secrets stay there)."""

    def __init__(self) -> None:
        self.by_room: dict[str, str] = {}

    def worker_token(self, room: str, identity: str) -> str:
        return self.by_room[room]


class _ForwardingRegistry(SessionRegistry):
    """The agent's mirror of its sessions' records: every table event is also sent to the authority."""

    def __init__(self, forward: Callable[[SessionRecord, Event, str | None], None]) -> None:
        super().__init__()
        self._forward = forward

    def apply(self, record: SessionRecord, event: Event, *, now: float, error: str | None = None) -> State:
        state = super().apply(record, event, now=now, error=error)
        self._forward(record, event, error)
        return state


def _image_bytes(data: str, suffix: str | None) -> bytes:
    """A Start's reference image; ValueError names what is wrong with it."""
    if suffix is not None and _IMAGE_SUFFIX.fullmatch(suffix) is None:
        raise ValueError(f"image_suffix {echo(suffix)} is not a file suffix (a dot and 1-10 letters or digits)")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error:
        raise ValueError("the image is not base64") from None


def _cause(value: str) -> DrainCause:
    """The drain cause the authority sent (its runtime's); an unknown one stops as a shutdown."""
    try:
        return DrainCause(value)
    except ValueError:
        return DrainCause.SHUTDOWN


def make_transport(welcome: wire.Welcome) -> Any:
    """The room transport the authority named in its Welcome (the agent publishes media next to its model)."""
    if welcome.transport == "livekit":
        from ..transport.livekit import LiveKitTransport

        return LiveKitTransport(welcome.livekit_url or "")
    return RemoteRooms(welcome.rooms_url or "")


class AgentSessions:
    """The runners of one agent's sessions, across its registrations (a new one after a fence starts empty)."""

    def __init__(self, worker: ModelWorker, metrics: ServerMetrics, send: Callable[[wire.Message], None]) -> None:
        self.worker = worker
        self.runners: dict[str, RoomRunner] = {}
        self._metrics = metrics
        self._send = send
        self._seq: dict[str, int] = {}
        self._images: dict[str, str] = {}
        # made with the first uploaded image (a killed agent without one leaves nothing); named by this process's
        # id, so that what a killed agent left is removed by the next agent or server on this host
        self._folder = ServerFolder("agent")
        self._issuer = _MintedTokens()
        self._deps: RunnerDeps | None = None
        self.transport: Any = None
        self._reported: dict[str, tuple[str, ...]] = {}  # session id -> the participants the authority was told
        self._moved: set[str] = set()  # sessions whose room changed since the last report
        self._room_moved = trio.Event()

    def attach(self, welcome: wire.Welcome) -> None:
        """A registration began: runners from now on use its transport and the authority's timeouts."""
        self.transport = make_transport(welcome)
        self._deps = RunnerDeps(
            issuer=self._issuer,  # type: ignore[arg-type]
            transport=self.transport,
            metrics=self._metrics,
            lifecycle=SessionLifecycle(_ForwardingRegistry(self._forward_event)),
            controller_timeout=welcome.controller_timeout,
            room_empty_timeout=welcome.room_empty_timeout,
            max_data_message_bytes=welcome.max_data_message_bytes,
            on_finished=self._finished,
            on_participants=self._participants_moved,
            checks_seats=False,  # the authority holds the seats, from the reports (:mod:`server.cluster.seat_reports`)
        )

    def start(self, message: wire.Start, *, refusal: str | None) -> None:
        """Run the session the authority started, or answer it finished with why not (``refusal`` or its image)."""
        assert self._deps is not None
        why = refusal
        if why is None and message.session_id in self.runners:
            why = "the worker cannot take this session"
        image_path = None
        if why is None and message.image is not None:
            try:
                image_path = self._store_image(_image_bytes(message.image, message.image_suffix), message.image_suffix)
            except ValueError as exc:
                why = f"the session's image was refused: {exc}"
            except OSError as exc:  # a full disk, a temporary directory gone: this session fails, not the agent
                why = f"the worker could not store the session's image: {exc.strerror or exc}"
        if why is not None:
            seq = self._seq.get(message.session_id, 0) + 1
            if message.session_id in self.runners:
                self._seq[message.session_id] = seq
            self._send(wire.SessionFinished(message.session_id, seq, why, DrainCause.START_FAILED.value))
            return
        if image_path is not None:
            self._images[message.session_id] = image_path
        record = SessionRecord(
            session_id=message.session_id,
            room=message.room,
            controller_identity=message.controller_identity,
            config=dict(message.config),
            prompt=message.prompt,
            image_path=image_path,
            created_at=time.time(),
            expires_at=None,
            deadline=None,  # the authority enforces the session timeout
            machine=StreamSessionMachine(State.ASSIGNED),
            worker_id=self.worker.worker_id,
        )
        self._issuer.by_room[message.room] = message.token
        runner = RoomRunner(self._deps, record, self.worker)
        self.runners[message.session_id] = runner
        self.worker.start_runner(runner.run)

    def _store_image(self, image: bytes, suffix: str | None) -> str:
        """The image in a file of the agent's own naming (the session id is the authority's text, never part of a
        path); OSError when it cannot be written, leaving no part of it behind (it raised out of the connection's
        reader: the agent ended with a traceback, and every session it ran was lost)."""
        handle, path = tempfile.mkstemp(dir=self._folder.make(), suffix=suffix or "")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(image)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return path

    def stop(self, message: wire.Stop) -> None:
        runner = self.runners.get(message.session_id)
        if runner is not None:
            runner.abort(_cause(message.cause)) if message.now else runner.drain(_cause(message.cause))

    def _next_seq(self, session_id: str) -> int:
        seq = self._seq[session_id] = self._seq.get(session_id, 0) + 1
        return seq

    def _shown(self, record: SessionRecord) -> tuple[str, ...]:
        """The participants as the authority is told them: at most what the wire carries (a LiveKit room may hold
        people whose tokens this cluster did not mint; past the limit the agent was lost for a protocol error).
        Past it, those the authority was told of and still here come first, then newcomers by name: cut by name
        alone, a crowd of viewers named before the controller dropped it from the report (the authority took it
        as gone), and those named last were never reported (the authority never sent them away)."""
        present = record.participants
        if len(present) <= MAX_PARTICIPANTS:
            return tuple(sorted(present))
        told = [identity for identity in self._reported.get(record.session_id, ()) if identity in present]
        newcomers = sorted(present.difference(told))
        return tuple(sorted([*told, *newcomers][:MAX_PARTICIPANTS]))

    def _told(self, record: SessionRecord) -> tuple[str, ...]:
        shown = self._reported[record.session_id] = self._shown(record)
        return shown

    def _participants_moved(self, record: SessionRecord) -> None:
        self._moved.add(record.session_id)
        self._room_moved.set()

    async def report_participants(self) -> None:
        """For the life of a registration: each running session's participants once they changed, the room as it
        stands, at most once every :data:`PARTICIPANTS_EVERY` seconds (a crowd coming and going costs the
        authority one message a session per pause, each at most ``MAX_PARTICIPANTS`` names)."""
        while True:
            await self._room_moved.wait()
            self._room_moved = trio.Event()
            moved, self._moved = self._moved, set()
            for session_id in sorted(moved):
                runner = self.runners.get(session_id)
                shown = None if runner is None else self._shown(runner.record)
                if shown is None or shown == self._reported.get(session_id):
                    continue  # ended (its finish says the room is left), or back as the authority knows it
                self._reported[session_id] = shown
                self._send(wire.Participants(session_id, self._next_seq(session_id), shown))
            await trio.sleep(PARTICIPANTS_EVERY)

    def _forward_event(self, record: SessionRecord, event: Event, error: str | None) -> None:
        seq = self._next_seq(record.session_id)
        self._send(
            wire.SessionEvent(
                record.session_id,
                seq,
                event.value,
                error=error,
                pipeline_session_id=record.pipeline_session_id,
                participants=self._told(record),
                drain_cause=None if record.drain_cause is None else record.drain_cause.value,
                drain_detail=record.drain_detail,
            )
        )

    def _finished(self, runner: RoomRunner, error: str | None) -> None:
        session_id = runner.record.session_id
        self.runners.pop(session_id, None)
        self._reported.pop(session_id, None)
        seq = self._seq.pop(session_id, 0) + 1
        cause = runner.record.drain_cause
        self._send(wire.SessionFinished(session_id, seq, error, None if cause is None else cause.value,
                                        told_room=runner.told_room))
        image = self._images.pop(session_id, None)
        if image is not None:
            with contextlib.suppress(OSError):
                os.unlink(image)
        self._issuer.by_room.pop(runner.record.room, None)

    async def stop_all(self, cause: str, *, hard: bool) -> None:
        """Stop every runner (bounded): ``hard`` fails them (fenced, exiting), else they drain at a chunk boundary."""
        runners = list(self.runners.values())
        for runner in runners:
            if hard:  # fenced or exiting: the authority settles these sessions with the loss
                runner.fail(cause, DrainCause.WORKER_FAILED)
            else:
                runner.drain(DrainCause.WORKER_DRAIN)
        with trio.move_on_after(RUNNER_STOP_GRACE):
            for runner in runners:
                await runner.finished.wait()

    async def until_empty(self) -> None:
        """Until every running session has finished (the caller bounds the wait)."""
        while self.runners:
            await next(iter(self.runners.values())).finished.wait()

    def close(self) -> None:
        """The agent exits: remove its folder (every session's image went with its session; a runner stopped past
        its grace may have left one)."""
        self._folder.remove()

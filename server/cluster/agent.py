"""The worker agent (``chunkline worker PIPE --authority URL``): a model worker that dials in.

One agent process holds one device group's model worker (service, lease, orchestrator),
its room runners and its transport, so media is published next to the model. It loads
its pipeline, dials the authority (no inbound port on the worker's host), registers under
a fresh id,
reports the capacity of the pipeline it loaded first, heartbeats, forwards each session's table
events in order, and runs the sessions the authority starts.

Cut off from the authority (no heartbeat acknowledged), the agent *fences* itself at
:func:`states.liveness.fence_at` — before the authority's deadline — by stopping every
session it runs, then registers again under a new id with the model it already
loaded. Refused at registration (another version or pipeline, a wrong token) it exits
with code 3. SIGTERM (or a drain from the authority) drains: no new sessions, live ones
finish or are stopped at the drain deadline at a chunk boundary, then it says goodbye
and exits 0.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import re
import secrets
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from engine import CapacityPlan
from states.liveness import fence_at
from states.restart_policy import RestartPolicy, RestartTracker
from states.stream_session import DrainCause, Event, State, StreamSessionMachine

from ..metrics import ServerMetrics
from ..model_worker import ModelWorker
from ..option_check import CHECK_OPTIONS_TIMEOUT
from ..reasons import public_reason
from ..requests import OptionsRefused
from ..registry import SessionRecord, SessionRegistry
from ..lifecycle import SessionLifecycle
from ..runner import RoomRunner, RunnerDeps
from . import wire
from .backoff import back_off
from .identity import chunkline_version, pipeline_digest, pipeline_name
from .rooms import RemoteRooms

__all__ = ["AgentOptions", "Agent", "parse_authority", "EXIT_REFUSED"]

log = logging.getLogger("chunkline.agent")

EXIT_REFUSED = 3
CONNECT_TIMEOUT = 10.0
RUNNER_STOP_GRACE = 10.0  # how long fenced or drained runners may take to finish their cleanup
OUTBOX = 1024
# an agent cut off from the authority registers again quickly at first, and gives up on a crash loop
REREGISTER_POLICY = RestartPolicy(base_delay=0.2, max_delay=5.0, max_failures=8, window=60.0)


def parse_authority(url: str) -> tuple[str, str, int]:
    """``tcp://host:port`` or ``tls://host:port`` -> (scheme, host, port); ValueError names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("tcp", "tls"):
        raise ValueError(f"--authority must be tcp://HOST:PORT or tls://HOST:PORT, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"--authority {url!r} needs a host and a port")
    return parts.scheme, parts.hostname, port


@attrs.frozen(kw_only=True)
class AgentOptions:
    pipeline: str
    authority: str
    token: str = attrs.field(repr=False)
    devices: tuple[int, ...] = ()
    max_sessions: int | str = "auto"
    worker_mode: str = "in-process"
    placement: str | None = None
    node: str = attrs.Factory(socket.gethostname)
    launcher: str = "external"
    slot: str | None = None
    tls_ca: str | None = None
    drain_deadline: float = 30.0
    control_idle_timeout: float = 10.0  # offered to the pipeline, as the authority offers its own workers
    default_fps: float = 16.0
    validate: bool = True  # the startup check, unless the authority runs with --skip-validation
    version: str = attrs.Factory(chunkline_version)


class _MintedTokens:
    """The runner asks for a worker token; the authority minted it (secrets stay there)."""

    def __init__(self) -> None:
        self.by_room: dict[str, str] = {}

    def worker_token(self, room: str, identity: str) -> str:
        return self.by_room[room]


class _ForwardingRegistry(SessionRegistry):
    """The agent's mirror of its sessions' records: every table event is also sent to the authority."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self._agent = agent

    def apply(self, record: SessionRecord, event: Event, *, now: float, error: str | None = None) -> State:
        state = super().apply(record, event, now=now, error=error)
        self._agent.forward_event(record, event, error)
        return state


class _RunnerHost:
    """What the agent's room runners use (:class:`~server.runner.RunnerDeps`), backed by the agent."""

    def __init__(self, agent: Agent, welcome: wire.Welcome, transport: Any) -> None:
        self.registry = _ForwardingRegistry(agent)
        self.issuer = _MintedTokens()
        self.transport = transport
        self.deps = RunnerDeps(
            issuer=self.issuer,  # type: ignore[arg-type]
            transport=transport,
            metrics=agent.metrics,
            lifecycle=SessionLifecycle(self.registry),
            controller_timeout=welcome.controller_timeout,
            room_empty_timeout=welcome.room_empty_timeout,
            max_data_message_bytes=welcome.max_data_message_bytes,
            on_finished=agent.session_finished,
        )


_IMAGE_SUFFIX = re.compile(r"\.[A-Za-z0-9]{1,10}")


def _image_bytes(data: str, suffix: str | None) -> bytes:
    """A Start's reference image; ValueError names what is wrong with it."""
    if suffix is not None and _IMAGE_SUFFIX.fullmatch(suffix) is None:
        raise ValueError(f"image_suffix {suffix[:40]!r} is not a file suffix (a dot and 1-10 letters or digits)")
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


def _make_transport(welcome: wire.Welcome) -> Any:
    if welcome.transport == "livekit":
        from ..transport.livekit import LiveKitTransport

        return LiveKitTransport(welcome.livekit_url or "")
    return RemoteRooms(welcome.rooms_url or "")


class Agent:
    def __init__(self, options: AgentOptions, *, service_loader: Callable[..., Any] | None = None) -> None:
        self.options = options
        self.scheme, self.host, self.port = parse_authority(options.authority)
        self.metrics = ServerMetrics()
        extra = {} if service_loader is None else {"service_loader": service_loader}
        self.worker = ModelWorker(
            "agent",
            pipeline=options.pipeline,
            gpu_ids=options.devices,
            max_sessions=options.max_sessions,
            on_ready=self._model_ready,
            on_failed=self._model_failed,
            worker_mode=options.worker_mode,
            placement=options.placement,
            # served to remote clients; the authority's assets directory is not this host's: no client paths
            offered={"control_idle_timeout": options.control_idle_timeout, "fps": options.default_fps,
                     "served": True, "assets_dir": None},
            validate=options.validate,
            **extra,
        )
        self.worker_id: str | None = None
        self.runners: dict[str, RoomRunner] = {}
        self._seq: dict[str, int] = {}
        self._images: dict[str, str] = {}
        self._nursery: trio.Nursery | None = None
        self._ready: wire.Ready | None = None
        self._model_failure: str | None = None
        self._model_settled = trio.Event()
        self._outbox: trio.MemorySendChannel[wire.Message] | None = None
        self._draining = False
        self._drained = trio.Event()
        self._tmp: str | None = None  # made with the first uploaded image: a killed agent without one leaves nothing
        self._host: _RunnerHost | None = None
        self._acked_sent_at = 0.0
        self._sent_at: dict[int, float] = {}
        self._flushed = trio.Event()

    # -- life --

    async def run(self) -> int:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._signals)
            # load before dialing: a model import that holds the interpreter must not
            # starve the heartbeats of a registered worker into a fence
            nursery.start_soon(self.worker.run)
            await self._model_settled.wait()
            if self._ready is None:
                log.error("the model worker failed: %s", self._model_failure)
                code = 1
            else:
                code = await self._registrations()
            await self._stop_runners("agent exiting", hard=True)
            self.worker.stop()
            nursery.cancel_scope.cancel()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._tmp)
        return code

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self._draining:
                    log.warning("second %s: exiting without waiting for sessions", signal.Signals(signum).name)
                    self._drained.set()
                    continue
                log.info("%s: draining (deadline %.0f s)", signal.Signals(signum).name, self.options.drain_deadline)
                self.begin_drain(self.options.drain_deadline)

    async def _registrations(self) -> int:
        """Register, serve, and register again (a fresh id) after a loss, on the shared restart policy."""
        restarts = RestartTracker(REREGISTER_POLICY)
        while True:
            outcome = await self._one_registration()
            if outcome == "refused":
                return EXIT_REFUSED
            if outcome == "drained" or self._draining:
                return 0
            if not await back_off(restarts, f"authority connection ended ({outcome})", f"agent at {self.options.authority}"):
                return 1

    async def _handshake(self, worker_id: str) -> tuple[wire.Channel, wire.Welcome] | str:
        options = self.options
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
                if self.scheme == "tls":
                    stream = wire.wrap_client_tls(stream, self.host, options.tls_ca)
                channel = wire.Channel(stream)
                hello = await channel.receive()
                if not isinstance(hello, wire.Hello):
                    raise wire.WireError(f"expected hello, got {hello.TYPE}")
                self._acked_sent_at = trio.current_time()  # the authority's deadline starts when register arrives
                await channel.send(
                    wire.Register(
                        worker_id=worker_id,
                        proof=wire.proof_for(options.token, hello.nonce, worker_id),
                        version=options.version,
                        pipeline=pipeline_name(options.pipeline),
                        pipeline_digest=pipeline_digest(options.pipeline),
                        node=options.node,
                        devices=options.devices,
                        launcher=options.launcher,
                        pid=os.getpid(),
                        slot=options.slot,
                    )
                )
                reply = await channel.receive()
        except (OSError, trio.TooSlowError, wire.ConnectionClosed, wire.WireError) as exc:
            return f"authority unreachable: {type(exc).__name__}: {exc}"
        if isinstance(reply, wire.Refused):
            log.error("the authority refused this worker: %s", reply.reason)
            await channel.aclose()
            return "refused"
        if not isinstance(reply, wire.Welcome):
            await channel.aclose()
            return f"protocol error: expected welcome, got {reply.TYPE}"
        return channel, reply

    async def _one_registration(self) -> str:
        worker_id = f"{self.options.node}-{secrets.token_hex(4)}"
        shaken = await self._handshake(worker_id)
        if isinstance(shaken, str):
            return shaken
        channel, welcome = shaken
        self.worker_id = worker_id
        self.worker.worker_id = worker_id  # runners join rooms as chunkline-<worker id>
        self._host = _RunnerHost(self, welcome, _make_transport(welcome))
        log.info("registered as %s with %s", worker_id, self.options.authority)
        outbox_send, outbox = trio.open_memory_channel[wire.Message](OUTBOX)
        self._outbox = outbox_send
        self._flushed = trio.Event()
        outcome = "connection lost"
        try:
            async with trio.open_nursery() as nursery:
                async def until(make: Callable[[], Awaitable[str]]) -> None:
                    nonlocal outcome
                    outcome = await make()
                    nursery.cancel_scope.cancel()

                transport_run = getattr(self._host.transport, "run", None)
                if transport_run is not None:  # LiveKit: its asyncio loop lives as long as this registration
                    await nursery.start(transport_run)
                nursery.start_soon(self._pump, channel, outbox)
                nursery.start_soon(until, lambda: self._read(channel))
                nursery.start_soon(until, lambda: self._heartbeat(welcome.heartbeat_interval))
                nursery.start_soon(until, lambda: self._fence(welcome.deadline))
                nursery.start_soon(until, self._until_drained)
                self.send(self._ready)  # type: ignore[arg-type]
                if self._draining:
                    self.send(wire.Drain(self.options.drain_deadline))
        finally:
            self._outbox = None
            if outcome != "drained":
                log.warning("worker %s: %s; stopping its sessions", worker_id, outcome)
                await self._stop_runners(f"worker fenced: {outcome}", hard=True)
            await channel.aclose()
        return outcome

    # -- the connection --

    def send(self, message: wire.Message) -> None:
        if self._outbox is None:
            return
        try:
            self._outbox.send_nowait(message)
        except trio.WouldBlock:
            log.error("the authority does not read: closing the connection")
            self._outbox.close()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the connection is gone; its loss is being handled

    async def _pump(self, channel: wire.Channel, outbox: trio.MemoryReceiveChannel[wire.Message]) -> None:
        try:
            async with outbox:
                async for message in outbox:
                    try:
                        await channel.send(message)
                    except wire.ConnectionClosed:
                        return
        finally:
            self._flushed.set()

    async def _flush_and_close(self) -> None:
        """Close the outbox and wait (bounded) until what it holds was sent."""
        if self._outbox is not None:
            self._outbox.close()
        with trio.move_on_after(2.0):
            await self._flushed.wait()

    async def _read(self, channel: wire.Channel) -> str:
        while True:
            try:
                message = await channel.receive()
            except wire.ConnectionClosed as exc:
                return f"connection lost: {exc}"
            except wire.WireError as exc:
                return f"protocol error: {exc}"
            if isinstance(message, wire.HeartbeatAck):
                sent = self._sent_at.pop(message.seq, None)
                if sent is not None:
                    self._acked_sent_at = max(self._acked_sent_at, sent)
                for seq in [s for s in self._sent_at if s < message.seq]:
                    del self._sent_at[seq]
            elif isinstance(message, wire.Start):
                self._start(message)
            elif isinstance(message, wire.Stop):
                runner = self.runners.get(message.session_id)
                if runner is not None:
                    runner.abort(_cause(message.cause)) if message.now else runner.drain(_cause(message.cause))
            elif isinstance(message, wire.CheckOptions):
                assert self._nursery is not None
                self._nursery.start_soon(self._check_options, message)
            elif isinstance(message, wire.Drain):
                self.begin_drain(message.deadline)
            elif isinstance(message, wire.Refused):
                return f"refused: {message.reason}"

    async def _heartbeat(self, interval: float) -> str:
        seq = 0
        while True:
            seq += 1
            self._sent_at[seq] = trio.current_time()
            while len(self._sent_at) > 64:
                del self._sent_at[min(self._sent_at)]
            self.send(wire.Heartbeat(seq, tuple(self.runners)))
            await trio.sleep(interval)

    async def _fence(self, deadline: float) -> str:
        while True:
            fence = fence_at(self._acked_sent_at, deadline)
            if trio.current_time() >= fence:
                return "no heartbeat acknowledged: fenced before the authority's deadline"
            await trio.sleep_until(fence)

    async def _check_options(self, message: wire.CheckOptions) -> None:
        """The pipeline's word on a create's options, for the authority (which bounds its own wait too)."""
        refused = error = None
        try:
            with trio.fail_after(CHECK_OPTIONS_TIMEOUT):
                await self.worker.check_options(message.options)
        except OptionsRefused as exc:
            refused = exc.reason
        except Exception as exc:
            log.warning("checking a session's options failed: %r", exc)
            error = "no answer in time" if isinstance(exc, trio.TooSlowError) else public_reason(exc)
        self.send(wire.OptionsChecked(message.check_id, refused, error))

    def _model_ready(self, worker: ModelWorker, capacity: int, plan: CapacityPlan) -> None:
        self._ready = wire.Ready(capacity, worker.kind or "unknown", plan.to_dict(), dict(worker.startup_check or {}))
        self._model_settled.set()

    def _model_failed(self, worker: ModelWorker, reason: str) -> None:
        self._model_failure = reason
        self._model_settled.set()

    # -- sessions --

    def _start(self, message: wire.Start) -> None:
        assert self._host is not None
        why = None
        if self._draining:
            why = "the worker is draining"
        elif self._ready is None or message.session_id in self.runners:
            why = "the worker cannot take this session"
        image = None
        if why is None and message.image is not None:
            try:
                image = _image_bytes(message.image, message.image_suffix)
            except ValueError as exc:
                why = f"the session's image was refused: {exc}"
        if why is not None:
            seq = self._seq.get(message.session_id, 0) + 1
            if message.session_id in self.runners:
                self._seq[message.session_id] = seq
            self.send(wire.SessionFinished(message.session_id, seq, why, None))
            return
        image_path = None
        if image is not None:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="chunkline-agent-")
            # a name of the agent's own: the session id is the authority's text, never part of a path
            handle, image_path = tempfile.mkstemp(dir=self._tmp, suffix=message.image_suffix or "")
            with os.fdopen(handle, "wb") as file:
                file.write(image)
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
            worker_id=self.worker_id,
        )
        self._host.issuer.by_room[message.room] = message.token
        runner = RoomRunner(self._host.deps, record, self.worker)
        self.runners[message.session_id] = runner
        self.worker.start_runner(runner.run)

    def forward_event(self, record: SessionRecord, event: Event, error: str | None) -> None:
        seq = self._seq[record.session_id] = self._seq.get(record.session_id, 0) + 1
        self.send(
            wire.SessionEvent(
                record.session_id,
                seq,
                event.value,
                error=error,
                pipeline_session_id=record.pipeline_session_id,
                participants=tuple(sorted(record.participants)),
            )
        )

    def session_finished(self, runner: RoomRunner, error: str | None) -> None:
        session_id = runner.record.session_id
        self.runners.pop(session_id, None)
        seq = self._seq.pop(session_id, 0) + 1
        cause = runner.record.drain_cause
        self.send(wire.SessionFinished(session_id, seq, error, None if cause is None else cause.value))
        image = self._images.pop(session_id, None)
        if image is not None:
            with contextlib.suppress(OSError):
                os.unlink(image)
        if self._host is not None:
            self._host.issuer.by_room.pop(runner.record.room, None)

    async def _stop_runners(self, cause: str, *, hard: bool) -> None:
        runners = list(self.runners.values())
        for runner in runners:
            if hard:  # fenced or exiting: the authority settles these sessions with the loss
                runner.fail(cause, DrainCause.WORKER_FAILED)
            else:
                runner.drain(DrainCause.WORKER_DRAIN)
        with trio.move_on_after(RUNNER_STOP_GRACE):
            for runner in runners:
                await runner.finished.wait()

    # -- drain --

    def begin_drain(self, deadline: float) -> None:
        if self._draining:
            return
        self._draining = True
        self.send(wire.Drain(deadline))
        self.spawn(self._drain, deadline)

    async def _drain(self, deadline: float) -> None:
        with trio.move_on_after(deadline):
            while self.runners:
                await next(iter(self.runners.values())).finished.wait()
        await self._stop_runners("worker_drain", hard=False)  # at a chunk boundary, never mid-chunk
        self._drained.set()

    async def _until_drained(self) -> str:
        await self._drained.wait()
        self.send(wire.Goodbye("drained"))
        await self._flush_and_close()
        return "drained"

"""The authority's side of the cluster: the agents' listener, the worker directory, the liveness clock.

``stream-serve --workers local|ray|external`` runs one :class:`ClusterAuthority` in the runtime's
nursery. It accepts agent connections (plain TCP, or TLS with a certificate), authenticates each
registration against the cluster token (and proves the token back, then tags every frame: see
:mod:`server.cluster.wire`), refuses another chunkline version or pipeline, and adds
each agent to the runtime's single admission book as a :class:`~server.cluster.remote.RemoteWorker`.
The pure :class:`~states.liveness.LivenessBook` decides who is alive: the first of a closed
socket, a missed heartbeat deadline or a launcher's death notice loses the worker — its sessions
fail with "worker lost: <cause>", its slots are released and the queue head goes to another
worker. Messages from a lost id are dropped and counted.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import trio

from engine import CapacityPlan
from states.liveness import DuplicateWorkerId, LivenessBook, loss_kind
from states.stream_session import DrainCause

from ..log_pace import WORKER_LINES_BURST, WORKER_LINES_PER_SECOND, LogPace
from ..orphaned_queue import end_if_nothing_will_run
from ..reasons import echo, public_reason
from ..settings import dialed_host
from . import proofs, tls, wire
from .agent_pace import AgentReadPace
from .busy import BUSY_WINDOW, MAX_BUSY_ANSWERS, BusyAnswers
from .capacity_limit import admitted_capacity
from .identity import chunkline_version, pipeline_digest, pipeline_name
from .registration_rules import MIN_REGISTERED, REGISTERED_PER_EXPECTED, Refusal
from .registration_rules import refusal as registration_refusal
from .remote import PlanView, RemoteWorker
from .stall_watch import StallWatch

if TYPE_CHECKING:
    from ..runtime import StreamRuntime

__all__ = ["ClusterAuthority", "Launcher", "UnknownWorkerId", "Refusal", "HANDSHAKE_TIMEOUT", "MAX_PENDING_HANDSHAKES",
           "MAX_BUSY_ANSWERS", "BUSY_WINDOW", "MIN_REGISTERED", "REGISTERED_PER_EXPECTED"]

log = logging.getLogger("chunkline.cluster")

HANDSHAKE_TIMEOUT = 10.0
#: seconds a dial waits for the rooms URL before it is refused for now: well under an agent's own wait for the hello
#: (under hypercorn without a public URL it is known only at the first request, and the agent's dials timed out)
ROOMS_URL_WAIT = 2.0
#: seconds a draining agent has past its drain deadline to say goodbye (it gives runners 10 s to stop, then flushes)
DRAIN_GRACE = 15.0
#: connections that have not registered yet, at most (each ends by its deadline); more are told Busy
#: (:class:`~server.cluster.busy.BusyAnswers`)
MAX_PENDING_HANDSHAKES = 32
RECENT_LOSSES = 32


class UnknownWorkerId(KeyError):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(worker_id)

    def __str__(self) -> str:
        return f"no live worker {self.worker_id!r}"


class Launcher(Protocol):
    """Starts and replaces agents (local processes, Ray actors); ``external`` has none."""

    name: str
    expected: int

    async def run(self, authority: ClusterAuthority, *, task_status: trio.TaskStatus[None]) -> None: ...

    def refusal(self, register: wire.Register) -> str | None:
        """Why an agent naming this launcher is not one of its own (refused for good), or None."""
        ...

    def worker_registered(self, worker: RemoteWorker) -> None: ...

    def worker_lost(self, worker: RemoteWorker, cause: str) -> None: ...

    def worker_left(self, worker: RemoteWorker) -> None: ...

    def view(self) -> list[dict[str, Any]]: ...

    def starts_more(self) -> bool:
        """Whether a slot may still start an agent (not every one gave up or was stopped)."""
        ...


class ClusterAuthority:
    def __init__(self, runtime: StreamRuntime, launcher: Launcher | None, *, token: str) -> None:
        settings = runtime.settings
        self.runtime = runtime
        self.launcher = launcher
        self.launcher_name = launcher.name if launcher is not None else "external"
        self.expected = launcher.expected if launcher is not None else settings.num_workers
        self.max_registered = max(REGISTERED_PER_EXPECTED * self.expected, MIN_REGISTERED)
        self.token = token
        self.token_given = settings.cluster_token is not None or settings.cluster_token_file is not None
        self.version = chunkline_version()
        self.pipeline = pipeline_name(settings.pipeline)
        self.digest = pipeline_digest(settings.pipeline)
        self.interval = settings.heartbeat_interval
        # an agent loads its pipeline before it dials, so its ready follows the welcome at once
        self.liveness = LivenessBook(settings.heartbeat_deadline, ready_within=max(HANDSHAKE_TIMEOUT, settings.heartbeat_deadline))
        self.stall = StallWatch(settings.heartbeat_deadline, settings.heartbeat_interval)  # its own, fencing its agents
        self.handles: dict[str, RemoteWorker] = {}
        self.losses: deque[dict[str, Any]] = deque(maxlen=RECENT_LOSSES)
        self.port: int | None = None
        self.rooms_url: str | None = None
        self._rooms_known = trio.Event()
        self._wake = trio.Event()
        self.refused = 0
        self.stale_of_gone = 0  # stale events counted by workers since lost or left (the summary keeps counting them)
        self._handshakes = 0
        # anyone who can connect can fail a handshake or be refused, thousands of times a second
        self._failed_handshakes, self._refusals = LogPace(log), LogPace(log)
        self._comings_and_goings = LogPace(log, burst=WORKER_LINES_BURST, per_second=WORKER_LINES_PER_SECOND)
        self._tls = (tls.server_tls_context(settings.cluster_tls_cert, settings.cluster_tls_key or "")
                     if settings.cluster_tls_cert else None)
        #: connections turned away because MAX_PENDING_HANDSHAKES were pending
        self.busy = BusyAnswers(token=token, version=self.version, wrap=self._wrap)

    # -- life --

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        settings = self.runtime.settings
        host = settings.cluster_host or settings.host
        listeners = await trio.open_tcp_listeners(settings.cluster_port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        log.info("cluster: agents dial %s (launcher %s)", self.authority_url, self.launcher_name)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self.serve_connection, listeners)
            nursery.start_soon(self._sweep)
            nursery.start_soon(self.stall.run)
            if self.launcher is not None:
                await nursery.start(self.launcher.run, self)
            task_status.started(self.port)

    def set_rooms_url(self, url: str) -> None:
        """The authority's HTTP base URL (agents join its local rooms there); known once hypercorn binds."""
        self.rooms_url = url
        self._rooms_known.set()

    @property
    def authority_url(self) -> str:
        settings = self.runtime.settings
        host = dialed_host(settings.cluster_host or settings.host)
        return f"{'tls' if settings.cluster_tls_cert else 'tcp'}://{host}:{self.port}"

    async def _sweep(self) -> None:
        """Lose workers whose heartbeat deadline passed (the book says who)."""
        while True:
            next_at = self.liveness.next_deadline()
            with trio.move_on_at(next_at if next_at is not None else trio.current_time() + 3600):
                await self._wake.wait()
            self._wake = trio.Event()
            for transition in self.liveness.expire(trio.current_time()):
                self._settle_loss(transition.worker_id, transition.cause or "heartbeat missed")

    # -- one agent --

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """One connection to the cluster port, from its hello to its end (the listener's handler; any byte stream)."""
        if self._handshakes >= MAX_PENDING_HANDSHAKES:
            await self.busy.turn_away(stream, self._handshakes)
            return
        self._handshakes += 1
        try:
            shaken = await self._handshake(stream)
        finally:
            self._handshakes -= 1
        if shaken is None:
            return
        first, channel, nonce = shaken
        channel.max_frame = wire.MAX_AGENT_FRAME_BYTES  # the peer proved the token
        worker = self._admit(first, channel)
        if worker is None:
            await channel.aclose()
            return
        cause: str | None
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await channel.send(self._welcome(worker, nonce, first.agent_nonce))
        except (trio.TooSlowError, wire.ConnectionClosed) as exc:
            cause = f"connection closed: sending welcome: {exc or 'no room within the handshake deadline'}"
        else:
            # every frame after the welcome is tagged under this connection's key
            channel.authenticate(proofs.frame_key(self.token, nonce, first.agent_nonce, first.worker_id), authority=True)
            channel.send_timeout = self.liveness.deadline  # an agent that takes no frame for that long is lost
            async with trio.open_nursery() as nursery:

                async def pump() -> None:
                    nonlocal cause
                    failed = await worker.pump()
                    if failed is not None:  # the sending side broke first: that is the cause
                        cause = f"connection closed: {failed}"
                        nursery.cancel_scope.cancel()

                nursery.start_soon(pump)
                cause = await self._read(worker)
                nursery.cancel_scope.cancel()
        if cause is not None:
            self._lost(worker.worker_id, cause)
            await worker.tell_loss()  # why, where the connection still takes it (its pump had no loss to say)
        await channel.aclose()

    def _wrap(self, stream: trio.abc.Stream) -> trio.abc.Stream:
        return stream if self._tls is None else tls.wrap_server_tls(stream, self._tls)

    def _handshake_failure(self, exc: BaseException) -> str:
        """A failed handshake in words, with what a TLS port most likely met (it read a bare ``TooSlowError``, or an
        ssl reason alone)."""
        if isinstance(exc, trio.TooSlowError):
            late = f"no register within {HANDSHAKE_TIMEOUT:g} s"
            return late + (" (a tcp:// agent at this TLS port? agents dial it tls://)" if self._tls is not None else "")
        said = str(exc) or type(exc).__name__
        if self._tls is not None and "EOF" in said:
            said += " (the peer left during the TLS handshake: an agent whose --tls-ca does not trust this certificate?)"
        return said

    async def _handshake(self, stream: trio.abc.Stream) -> tuple[wire.Register, wire.Channel, str] | None:
        """Hello, then the peer's Register within the deadline: the registration and the nonce it answered,
        or None (refused or failed)."""
        settings = self.runtime.settings
        channel = wire.Channel(self._wrap(stream), max_frame=wire.MAX_HANDSHAKE_FRAME_BYTES)
        nonce = secrets.token_hex(16)
        with trio.move_on_after(ROOMS_URL_WAIT):
            await self._rooms_known.wait()  # before the handshake: the worker's deadline starts at its register
        refusal: Refusal | None
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await channel.send(wire.Hello(nonce, self.version))
                first = await channel.receive()
        except wire.WireError as exc:
            first, refusal = None, Refusal(str(exc))
        except (trio.TooSlowError, wire.ConnectionClosed, OSError) as exc:
            self._failed_handshakes.warning("cluster: a connection from %s failed its handshake: %s", _peer(stream),
                                            self._handshake_failure(exc))
            await channel.aclose()
            return None
        else:
            refusal = registration_refusal(self, first, nonce)
        if refusal is None and self.rooms_url is None and settings.transport == "local":
            refusal = Refusal("the authority does not know its rooms URL yet; try again", transient=True)
        if refusal is not None:
            self.refused += 1
            who = _peer(stream) + (f" (worker {echo(first.worker_id)}, node {echo(first.node)})"
                                   if isinstance(first, wire.Register) else "")
            self._refusals.warning("cluster: refused a worker%s from %s: %s", " for now" if refusal.transient else "",
                                   who, refusal.reason)
            proof = None
            if isinstance(first, wire.Register):  # the agent may check that the refusal comes from a token holder
                proof = proofs.refusal_proof(self.token, nonce, first.agent_nonce, first.worker_id, refusal.reason,
                                             refusal.transient)
            with trio.move_on_after(2.0):
                try:
                    await channel.send(wire.Refused(refusal.reason, proof, refusal.transient))
                except wire.ConnectionClosed:
                    pass
            await channel.aclose()
            return None
        assert isinstance(first, wire.Register)
        return first, channel, nonce

    def _admit(self, message: wire.Register, channel: wire.Channel) -> RemoteWorker | None:
        now = trio.current_time()
        try:
            self.liveness.register(message.worker_id, now)
        except DuplicateWorkerId:
            return None
        worker = RemoteWorker(
            message.worker_id,
            channel=channel,
            node=message.node,
            devices=message.devices,
            launcher=message.launcher,
            pid=message.pid,
            slot=message.slot,
            liveness=self.liveness, deadlines_changed=lambda: self._wake.set(),  # stop deadlines: a sweep looks
        )
        self.handles[worker.worker_id] = worker
        self.runtime.add_worker(worker)
        if self.launcher is not None:
            self.launcher.worker_registered(worker)
        self._comings_and_goings.info("cluster: worker %s registered (node %s, devices %s, %s)", worker.worker_id,
                                      worker.node, list(worker.gpu_ids), worker.launcher)
        self._wake.set()
        return worker

    def _welcome(self, worker: RemoteWorker, nonce: str, agent_nonce: str) -> wire.Welcome:
        settings = self.runtime.settings
        return wire.Welcome(
            worker_id=worker.worker_id,
            heartbeat_interval=self.interval,
            deadline=self.liveness.deadline,
            transport=settings.transport,
            rooms_url=self.rooms_url,
            livekit_url=settings.livekit_url,
            controller_timeout=settings.controller_timeout,
            room_empty_timeout=settings.room_empty_timeout,
            max_data_message_bytes=settings.max_data_message_bytes,
            proof=proofs.authority_proof(self.token, nonce, agent_nonce, worker.worker_id),
        )

    async def _read(self, worker: RemoteWorker) -> str | None:
        """Dispatch the agent's messages; returns the loss cause, or None when it left cleanly."""
        metrics = self.runtime.metrics
        pace = AgentReadPace(worker.worker_id)
        while True:
            try:
                message = await worker.channel.receive()
            except wire.ConnectionClosed as exc:
                return f"connection closed: {exc}"
            except wire.WireError as exc:
                return f"protocol error: {exc}"
            await pace.after(worker.channel.last_frame_bytes)  # none of it may hold the event loop
            now = trio.current_time()
            if not self.liveness.heard(worker.worker_id, now):
                metrics.record_stale_messages()
                if worker.lost_cause is not None:
                    return None  # already lost: the connection is being closed
                continue
            self._wake.set()
            before = worker.stale_events
            if isinstance(message, wire.Heartbeat):
                worker.send(wire.HeartbeatAck(message.seq))
            elif isinstance(message, wire.SessionEvent):
                worker.on_session_event(message, now)
            elif isinstance(message, wire.Participants):
                worker.on_participants(message)
            elif isinstance(message, wire.SessionFinished):
                worker.on_session_finished(message)
            elif isinstance(message, wire.OptionsChecked):
                worker.on_options_checked(message)
            elif isinstance(message, wire.Ready):
                if worker.said_ready:  # its capacity and plan were taken once: a change was dropped without a word
                    return "protocol error: ready a second time (a registration says ready once)"
                worker.said_ready = True
                self._ready(worker, message)
            elif isinstance(message, wire.Failed):  # its word: whether its process is gone nobody has seen
                return f"the agent said it failed: {public_reason(message.reason)}"
            elif isinstance(message, wire.Drain):
                self.drain(worker.worker_id, message.deadline, tell_agent=False)
            elif isinstance(message, wire.Goodbye):
                if not self._left(worker):
                    return "protocol error: goodbye from a worker that was not draining"
                return None
            else:
                return f"protocol error: unexpected {message.TYPE} from an agent"
            if worker.stale_events > before:
                metrics.record_stale_messages(worker.stale_events - before)

    def _ready(self, worker: RemoteWorker, message: wire.Ready) -> None:
        if not self.liveness.ready(worker.worker_id, trio.current_time()):
            return  # draining already: it takes no sessions
        worker.plan = PlanView(message.plan)
        worker.kind = message.kind
        worker.startup_check = message.startup_check or None
        worker.settings_taken = message.settings_taken
        worker.worker_mode = message.worker_mode
        worker.inputs_taken = frozenset(name for name, taken in (("prompt", message.takes_prompt),
                                                                  ("image", message.takes_image)) if taken)
        plan = CapacityPlan(**{k: message.plan[k] for k in ("computed_capacity", "effective_capacity", "configured_limit", "limiting_device")})
        capacity = admitted_capacity(message.capacity, self.runtime.settings.max_sessions_per_worker, worker.worker_id)
        self.runtime.agent_ready(worker, capacity, plan)

    # -- losses and departures --

    def lose(self, worker_id: str, cause: str) -> None:
        """A launcher's notice (its process exited, its Ray actor died)."""
        self._lost(worker_id, cause)

    def _lost(self, worker_id: str, cause: str) -> None:
        if self.liveness.lose(worker_id, cause, trio.current_time()):
            self._settle_loss(worker_id, cause)

    def _settle_loss(self, worker_id: str, cause: str) -> None:
        """The book made the worker LOST: fail its sessions, release its slots, tell the launcher."""
        worker = self.handles.get(worker_id)
        if worker is None:
            return
        cause = self.stall.cause(cause, trio.current_time())  # the authority's own stall, where that explains it
        self._comings_and_goings.warning("cluster: worker %s lost: %s", worker_id, cause)
        self.runtime.metrics.record_worker_lost(loss_kind(cause))
        self.losses.append({"worker_id": worker_id, "node": worker.node, "cause": cause, "slot": worker.slot})
        worker.lose(cause)
        self.stale_of_gone += worker.stale_events
        self.runtime.retire_worker(worker, f"worker lost: {cause}")
        del self.handles[worker_id]
        if self.launcher is not None:
            self.launcher.worker_lost(worker, cause)

    def _left(self, worker: RemoteWorker) -> bool:
        """A drained worker said goodbye; False (nothing changed) when the table has it not draining."""
        if not self.liveness.leave(worker.worker_id, trio.current_time()):
            return False
        self._comings_and_goings.info("cluster: worker %s drained and left", worker.worker_id)
        worker.lose("left after draining", tell=False)
        self.stale_of_gone += worker.stale_events
        self.runtime.retire_worker(worker, "the worker left after draining")
        self.handles.pop(worker.worker_id, None)
        if self.launcher is not None:
            self.launcher.worker_left(worker)
        return True

    def drain(self, worker_id: str, deadline: float, *, tell_agent: bool = True) -> None:
        worker = self.handles.get(worker_id)
        if worker is None:
            raise UnknownWorkerId(worker_id)
        if self.liveness.drain(worker_id, trio.current_time(), within=deadline + DRAIN_GRACE):
            self.runtime.drain_in_book(worker_id)
            self._wake.set()  # the sweep now also watches the drain's deadline
        if tell_agent:
            worker.send(wire.Drain(deadline))

    def stop(self) -> None:
        for worker in list(self.handles.values()):
            worker.stop()

    # -- views --

    def view(self, worker_id: str, now: float) -> dict[str, Any] | None:
        liveness = self.liveness.view(worker_id)
        worker = self.handles.get(worker_id)
        if liveness is None or worker is None:
            return None
        return {
            "node": worker.node,
            "devices": list(worker.gpu_ids),
            "liveness": liveness.state.value,
            "heartbeat_age": round(liveness.heartbeat_age(now), 3),
            "launcher": worker.launcher,
            "slot": worker.slot,
            "pid": worker.pid,
        }

    def slot_stays_down(self, cause: DrainCause, reason: str) -> None:
        """A launcher's slot stays down (drained, or given up): the queued sessions end now, with ``cause`` and
        ``reason``, when nothing will run them (:mod:`server.orphaned_queue`)."""
        end_if_nothing_will_run(self.runtime, cause, reason)

    def why_no_agent(self) -> str:
        """Why no agent is registered, for a create's 503: each launcher slot's own reason (drained on purpose, given
        up, starting), then where agents dial. It named only the address, as if an agent were on its way, after the
        only slot was drained."""
        slots = [] if self.launcher is None else [f"{slot['slot']}: {slot['reason']}" for slot in self.launcher.view()
                                                  if slot["reason"]]
        return "; ".join([*slots, f"no worker agent is registered; agents dial {self.authority_url}"])

    def agent_may_join(self) -> bool:
        """Whether an agent may still register: False once every slot of the launcher gave up or stopped and no
        one else holds the token its agents prove (this server made it). A create's 503 then sends no Retry-After:
        it asked clients to retry every 10 s for ever after the launcher said it would start no agent again."""
        if self.launcher is None or self.token_given:
            return True
        return self.launcher.starts_more()

    def summary(self) -> dict[str, Any]:
        return {
            "launcher": self.launcher_name,
            "authority_url": self.authority_url if self.port is not None else None,
            "workers_expected": self.expected,
            "workers_limit": self.max_registered,
            "liveness": self.liveness.counts(),
            "stale_messages_dropped": self.liveness.stale_dropped + self.stale_of_gone
            + sum(w.stale_events for w in self.handles.values()),
            "registrations_refused": self.refused,
            "connections_shed": self.busy.shed,
            "recent_losses": list(self.losses),
        }


def _peer(stream: trio.abc.Stream) -> str:
    """The address a connection came from, as the log names it (``host:port``)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # AttributeError: a stream of no socket
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return "an unknown address"

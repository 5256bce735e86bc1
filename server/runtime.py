"""The stream runtime: registry + admission + model workers + room runners, in one trio nursery.

Every status change goes through the stream-session table (the registry) and
every slot through the admission book; this module only wires them to time and
to the runners. Nothing here waits on pipeline work: workers load their
pipelines in their own tasks (threads for the imports), runners create
pipeline sessions in theirs, and the API calls below return at once.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import trio

from engine import CapacityPlan
from states.admission import Admission, AdmissionBook, AdmissionTransition, InvalidSetting, Transition
from states.machine import IllegalTransition
from states.restart_policy import RestartPolicy
from states.stream_session import IN_QUEUE, RETAINING, DrainCause
from states.worker import TERMINAL as WORKER_TERMINAL

from .metrics import ServerMetrics
from .in_process_workers import InProcessWorkers
from .model_worker import ModelWorker
from .lifecycle import SessionLifecycle, shutdown_outcome
from .log_pace import WORKER_LINES_BURST, WORKER_LINES_PER_SECOND, LogPace
from .registry import SessionRecord, SessionRegistry
from . import drain_request, option_check, runtime_views
from .queued_ends import QueuedEnds
from .requests import CreateSession
from .room_follow import RoomFollow
from .runner import RoomRunner, RunnerDeps
from .runtime_errors import NO_WORKER_RETRY_AFTER, NoWorker, SessionConflict, ViewerLimit
from .settings import ServerSettings
from .stop_cuts import CutOnStop
from .stop_guard import HeldLoop
from .tokens import TokenIssuer, validate_client_identity
from .transport import RoomTransport
from .uploads import UploadFolder
from .viewer_seats import MAX_VIEWERS_PER_SESSION, ViewerSeats
from .worker_slots import WorkerSlots

__all__ = ["StreamRuntime", "CreateSession", "SessionConflict", "Created", "NoWorker", "ViewerLimit",
           "NO_WORKER_RETRY_AFTER", "MAX_VIEWERS_PER_SESSION"]

log = logging.getLogger("chunkline.runtime")

#: seconds live sessions have to drain as the server stops (then the ones left are aborted, as long again)
SHUTDOWN_GRACE = 20.0

SWEEP_PERIOD = 1.0
DELETE_WAIT = 15.0
#: creates whose image is being decoded at once (each up to MAX_IMAGE_PIXELS, in a thread); the rest wait
IMAGE_DECODES_AT_ONCE = 2
#: the error of a session still queued when the server stops
SHUTDOWN_REASON = "the server shut down before the session could start"


@attrs.frozen
class Created:
    record: SessionRecord
    admission: Admission
    token: str | None


class StreamRuntime:
    def __init__(self, settings: ServerSettings, *, issuer: TokenIssuer, transport: RoomTransport, metrics: ServerMetrics,
                 service_loader: Callable[..., Any] | None = None, restart_policy: RestartPolicy | None = None) -> None:
        self.settings = settings
        self.issuer = issuer
        self.transport = transport
        self.metrics = metrics
        self.registry = SessionRegistry(retention_count=settings.terminal_retention_count)
        self.lifecycle = SessionLifecycle(self.registry, lambda: metrics.set_sessions(self.registry.counts()))
        self.viewer_seats = ViewerSeats(issuer.ttl_seconds, self.registry.in_room)
        #: each session's room from its creation: until it ends (local rooms), or until its worker sees it (LiveKit)
        self.room_follow = RoomFollow(transport)
        self.runner_deps = RunnerDeps(
            issuer=issuer, transport=transport, metrics=metrics, lifecycle=self.lifecycle,
            controller_timeout=settings.controller_timeout, room_empty_timeout=settings.room_empty_timeout,
            max_data_message_bytes=settings.max_data_message_bytes, on_finished=self.session_finished,
            room_followed=self.room_follow.active, on_room_seen=self.room_follow.handed_over,
        )
        self.book = AdmissionBook(settings.queue_size)
        self.queued_ends = QueuedEnds(
            self.book, end_one=self._end_queued, follow=self._follow, publish=lambda: runtime_views.publish_gauges(self)
        )
        self.workers: dict[str, ModelWorker] = {}
        self._ready_lines = LogPace(log, burst=WORKER_LINES_BURST, per_second=WORKER_LINES_PER_SECOND)  # agents in a loop
        self.forget_when_free: set[str] = set()  # replaced workers forgotten once their last session's place is freed
        self.runners: dict[str, RoomRunner] = {}
        self.restart_policy = restart_policy or RestartPolicy()
        self.slots = WorkerSlots(self.restart_policy)
        self.cluster: Any = None  # the ClusterAuthority when workers are agents (--workers local|ray|external)
        self.in_process = InProcessWorkers(self, service_loader, DELETE_WAIT)
        self._nursery: trio.Nursery | None = None
        self.uploads = UploadFolder()
        self.held_loop = HeldLoop(log)  # a stop's look at a loop a pipeline holds (server/stop_guard.py)
        #: option checks under way at once (each is a message to a worker: a burst of creates stays bounded)
        self.option_checks = option_check.OptionCheckers()
        self.image_decodes = trio.CapacityLimiter(IMAGE_DECODES_AT_ONCE)  # creates' images checked at once
        self._shut_down = trio.Event()
        self.started = False
        self.closing = False
        self.started_at = time.time()
        #: creates whose rooms the transport is making: each was promised a place, which it takes on landing
        self.rooms_opening = 0
        #: a create's checks before it is booked (its image's decode, its options'): the stop cuts them short
        self.checks_before_booking = CutOnStop()

    # -- life ------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.held_loop.start()  # in the app's loop, until the run ends
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.settings.workers == "in-process":
                    self.in_process.start()
                else:
                    from .cluster.launchers import make_authority

                    self.cluster = make_authority(self)
                    await nursery.start(self.cluster.run)
                nursery.start_soon(self._sweep)
                nursery.start_soon(self.room_follow.run)  # LiveKit: looks into the rooms no worker of ours is in yet
                self.started = True
                runtime_views.publish_gauges(self)
                task_status.started()
        finally:
            self.held_loop.stop()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run a small task in the runtime's nursery (e.g. publishing an event)."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    def end_service_processes_now(self) -> None:
        """For a process about to end at once: its workers' service processes go, with their shared memory."""
        for worker in self.workers.values():
            worker.end_service_process_now()

    async def drain_for_stop(self) -> None:
        """The server is about to stop serving: drain every session (within :data:`SHUTDOWN_GRACE`, twice), then
        send the rooms' clients away, while their connections still carry the sessions' last words."""
        await self.shutdown(SHUTDOWN_GRACE)
        close_clients = getattr(self.transport, "close_clients", None)  # the local rooms' (LiveKit's are its own)
        if close_clients is not None:
            close_clients()

    @property
    def drained(self) -> bool:
        """The shutdown's drain is over (its last line, ``shutdown complete``, said so)."""
        return self._shut_down.is_set()

    async def shutdown(self, grace: float) -> None:
        """Drain every live session within ``grace`` seconds, then stop the workers (idempotent)."""
        if self.closing:
            await self._shut_down.wait()
            return
        self.closing = True
        self.checks_before_booking.cut()
        live, queued = list(self.runners.values()), self._queued_records()
        log.info("shutting down: draining %d live session(s), withdrawing %d queued one(s) (grace %.0f s)", len(live),
                 len(queued), grace)
        # a queued session never ran: it is told why it never will (a failure with the reason, not a quiet close)
        await self.queued_ends.end(queued, DrainCause.SHUTDOWN, SHUTDOWN_REASON)
        for runner in list(self.runners.values()):
            self._drain(runner.record, DrainCause.SHUTDOWN)
        with trio.move_on_after(grace):
            for runner in list(self.runners.values()):
                await runner.finished.wait()
        aborted = list(self.runners.values())  # still live past the grace: stopped at once now
        for runner in aborted:
            runner.abort()
        with trio.move_on_after(grace):
            for runner in list(self.runners.values()):
                await runner.finished.wait()
        self.slots.stop()
        for worker in self.workers.values():
            worker.stop()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        self.uploads.remove()
        self._shut_down.set()  # first: a stop signal's handler may run as soon as the line below is out
        log.info("shutdown complete: %s", shutdown_outcome(live, aborted))

    # -- workers -----------------------------------------------------------------

    def worker_ready(self, worker: ModelWorker, capacity: int, plan: CapacityPlan) -> None:
        now = trio.current_time()
        transitions = self.book.set_capacity(worker.worker_id, capacity, now)
        transitions += self.book.worker_ready(worker.worker_id, now)
        self._ready_lines.info("worker %s ready: capacity %d", worker.worker_id, capacity)
        self._follow(transitions)

    def worker_failed(self, worker: ModelWorker, reason: str, *, permanent: bool = False) -> None:
        """A worker died: its sessions fail with its cause, and its slot backs off and restarts (or gives up: on a
        crash loop, or at once when it refused its configuration, ``permanent``)."""
        now = trio.current_time()
        if self.book.worker_state(worker.worker_id) not in WORKER_TERMINAL:
            self._follow(self.book.fail_worker(worker.worker_id, now))
        for runner in list(self.runners.values()):
            if runner.worker is worker:
                runner.fail(f"worker {worker.worker_id} failed: {reason}")
        slot = self.slots.holding(worker)
        if slot is not None and not self.closing and not self.in_process.failed(worker, reason, now, permanent=permanent):
            if not self.book.can_place():  # nothing will ever run the queued sessions: they fail with the reason
                reason = f"no worker can take the session: {slot.tracker.describe(now)}"
                self.spawn(self.queued_ends.end, self._queued_records(), DrainCause.WORKER_FAILED, reason)
        runtime_views.publish_gauges(self)

    def _notice_failing(self, now: float) -> None:
        """A worker out of service (failing, or told to fail) takes nothing more, before the book can promote onto it.

        Its failure report comes once the service has left ``running()``; sessions ending before that
        would otherwise hand their slots to queued sessions on the same dying worker.
        """
        for worker_id, worker in self.workers.items():
            if worker.out_of_service and self.book.worker_state(worker_id) not in WORKER_TERMINAL:
                self._follow(self.book.fail_worker(worker_id, now))

    def _queued_records(self) -> list[SessionRecord]:
        """The queued sessions' records, head first (from the book's queue, not a pass over every record)."""
        return [record for record in map(self.registry.find, self.book.queued_ids()) if record is not None]

    def serving_at(self, url: str) -> None:
        """The HTTP server is bound at ``url``: agents join the local rooms there (or at --public-url)."""
        if self.cluster is not None:
            self.cluster.set_rooms_url(self.settings.public_url or url)

    def first_served_at(self, host: str, port: int) -> None:
        """A request came in at ``host:port`` before anything said where the server listens (plain hypercorn)."""
        if self.cluster is not None and self.cluster.rooms_url is None:  # asked on every request: the look first
            self.serving_at(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")

    def add_worker(self, worker: Any) -> None:
        """A worker agent registered: it joins the one admission book (STARTING until it is ready)."""
        self.workers[worker.worker_id] = worker
        self.book.add_worker(worker.worker_id, 1, trio.current_time())
        runtime_views.publish_gauges(self)

    def agent_ready(self, worker: Any, capacity: int, plan: CapacityPlan) -> None:
        """A worker agent loaded its pipeline: its capacity joins the book and the queue head may start."""
        self.worker_ready(worker, capacity, plan)

    def forget_worker(self, worker: Any) -> None:
        """Drop a failed worker from the book and the worker table; one that still retains sessions is dropped once
        the last of them frees its place (it stayed for ever: shown in metadata, kept however long the server ran)."""
        try:
            self.book.remove_worker(worker.worker_id, trio.current_time())
        except InvalidSetting:
            self.forget_when_free.add(worker.worker_id)
            return
        self.forget_when_free.discard(worker.worker_id)
        self.workers.pop(worker.worker_id, None)

    def retire_worker(self, worker: Any, reason: str) -> None:
        """A worker agent is gone (lost or left): fail its sessions with the reason, free its slots, forget it."""
        self.worker_failed(worker, reason)
        self.book.remove_worker(worker.worker_id, trio.current_time())
        self.workers.pop(worker.worker_id, None)
        runtime_views.publish_gauges(self)

    def drain_in_book(self, worker_id: str) -> None:
        """No new sessions for the worker; it stops once it retains none."""
        try:
            self._follow(self.book.drain_worker(worker_id, trio.current_time()))
        except IllegalTransition:
            pass  # starting, already draining, failed or stopped: nothing to take it out of

    def drain_worker(self, worker_id: str, deadline: float) -> dict[str, Any]:
        """``POST /v1/service/workers/{id}/drain`` (:mod:`server.drain_request`)."""
        return drain_request.drain_worker(self, worker_id, deadline)

    # -- sessions ------------------------------------------------------------------

    @staticmethod
    def new_session() -> tuple[str, str]:
        """A new session's id and the name of its room."""
        session_id = secrets.token_hex(8)
        return session_id, f"chunkline-{session_id}"

    def would_take_session(self) -> bool:
        """Whether :meth:`create_session` would admit or queue a session now, rather than refuse it (the creates
        whose rooms are being made count as having taken their places)."""
        return not self.closing and self.book.can_place() and self.book.would_admit(self.rooms_opening)

    @contextlib.contextmanager
    def opening_room(self) -> Iterator[None]:
        """Count a create as promised a place while its room is made, so that a burst of creates makes rooms
        for at most as many sessions as the server would take (the rest are refused before any room)."""
        self.rooms_opening += 1
        try:
            yield
        finally:
            self.rooms_opening -= 1

    def create_session(self, request: CreateSession, *, named: tuple[str, str], image_bytes: bytes | None = None) -> Created:
        """Admit (200), queue (202) or reject (429) a new session, or raise NoWorker (503); never waits.

        ``named``: the session's id and room from :meth:`new_session` (a room the transport made already)."""
        identity = validate_client_identity(request.identity)
        if not self.closing and not self.book.can_place():
            now = trio.current_time()
            reasons = "; ".join(f"{name}: {why['reason']}" for name, why in self.slots.status(now).items() if why["reason"])
            if self.cluster is not None and not self.book.workers():  # it said nothing of agents an operator awaits
                reasons = self.cluster.why_no_agent()
            retry = self.slots.retry_after(now)
            if retry is None and self.cluster is not None and self.cluster.agent_may_join():
                retry = NO_WORKER_RETRY_AFTER
            raise NoWorker("no worker is running or starting" + (f" ({reasons})" if reasons else ""), retry)
        session_id, room = named
        now = trio.current_time()
        wall = time.time()
        timeout = self.settings.session_timeout
        record = SessionRecord(
            session_id=session_id,
            room=room,
            controller_identity=identity,
            config=dict(request.config),
            prompt=request.prompt,
            image_path=request.image_path,
            created_at=wall,
            expires_at=wall + timeout,
            deadline=now + timeout,
        )
        if image_bytes is not None:
            self.uploads.store(record, image_bytes)
        self.registry.add(record)
        if self.closing:
            admission = Admission(status="rejected", session_id=session_id, reason="shutting_down")
            transitions: list[Transition] = []
        else:
            self._notice_failing(now)
            admission, transitions = self.book.admit(session_id, now, ahead=self.rooms_opening)
        self.metrics.record_admission(admission.status)
        if admission.status == "rejected":
            self.lifecycle.reject(record, admission.reason or "rejected")
            self.registry.remove(session_id)
            self.uploads.discard(record)
            runtime_views.publish_gauges(self)
            return Created(record, admission, None)
        token = self.issuer.controller_token(room, identity, lasting=timeout)  # its session's life: it has no other
        self.room_follow.start(record)  # before a runner starts: it reads the record, and subscribes to nothing
        if admission.status == "queued":
            self.lifecycle.queue(record)
        self._follow(transitions)
        return Created(record, admission, token)

    def queue_position(self, record: SessionRecord) -> int | None:
        """The session's place in the queue (O(log n): a page of many sessions costs its own length)."""
        if record.status not in IN_QUEUE:
            return None
        return self.book.queue_position(record.session_id)

    def get(self, session_id: str) -> SessionRecord:
        return self.registry.get(session_id)

    async def delete_session(self, session_id: str) -> SessionRecord:
        """Drain and close (idempotent for terminal sessions); waits for the drain, bounded."""
        record = self.registry.get(session_id)
        if record.is_terminal:
            return record
        if record.status in IN_QUEUE:
            self._withdraw(record)
            return record
        runner = self._drain(record, DrainCause.DELETED)
        if runner is not None:
            with trio.move_on_after(DELETE_WAIT):
                await runner.finished.wait()
        return record

    def viewer_token(self, session_id: str, identity: str, present: frozenset[str] = frozenset()) -> str:
        """A viewer token for the session's room, if a viewer seat is free (:mod:`server.viewer_seats`); ``present``:
        who a list of the room made for this request saw, besides the record's count (LiveKit: ``look_now``)."""
        record = self.registry.get(session_id)
        identity = validate_client_identity(identity)
        if self.closing and not record.is_terminal:
            raise SessionConflict(f"session {session_id} takes no new viewers: the server is shutting down")
        if not record.takes_viewers:
            raise SessionConflict(f"session {session_id} is {record.status.value}: it takes no new viewers")
        self.viewer_seats.hand_out(record, identity, present)
        return self.issuer.viewer_token(record.room, identity)

    # -- internal moves ------------------------------------------------------------------

    def _withdraw(self, record: SessionRecord) -> None:
        self._notice_failing(trio.current_time())
        self._end_queued(record, DrainCause.DELETED)
        runtime_views.publish_gauges(self)

    def _end_queued(self, record: SessionRecord, cause: DrainCause, error: str | None = None) -> None:
        """A queued session ends as the table says for ``cause``; its upload and its queue place go with it (the
        caller publishes the gauges: a pass over many, once a batch)."""
        self.lifecycle.end_queued(record, cause, error)
        self.room_follow.stop(record)
        self.uploads.discard(record)
        self.book.release(record.session_id, trio.current_time())  # a queued place: no one moves up onto a slot
        self.metrics.record_session_finished(record.session_id, record.status.value)

    def _drain(self, record: SessionRecord, cause: DrainCause) -> RoomRunner | None:
        """Start the drain of a live session (the first cause wins); the runner finishes it."""
        runner = self.runners.get(record.session_id)
        if runner is not None:
            runner.drain(cause)
        else:
            self.lifecycle.drain(record, cause)
        runtime_views.publish_gauges(self)
        return runner

    def _follow(self, transitions: list[Transition]) -> None:
        """Carry the book's decisions into the records and start runners for new assignments."""
        for transition in transitions:
            if not isinstance(transition, AdmissionTransition) or transition.kind not in ("assigned", "promoted"):
                continue
            record = self.registry.find(transition.session_id)
            if record is None or record.is_terminal:
                continue
            self.lifecycle.assign(record, transition.worker_id)  # type: ignore[arg-type]
            worker = self.workers[transition.worker_id]  # type: ignore[index]
            self.runners[record.session_id] = worker.open_runner(self, record)
        runtime_views.publish_gauges(self)

    def session_finished(self, runner: RoomRunner, error: str | None) -> None:
        """A runner is done: settle its record, release the slot, admit the queue head."""
        record = runner.record
        now = trio.current_time()
        self.lifecycle.settle(record, error, worker_told=runner.told_room)
        self.room_follow.stop(record)
        self.runners.pop(record.session_id, None)
        self.uploads.discard(record)
        self.metrics.record_session_finished(record.session_id, record.status.value)
        self._notice_failing(now)
        if self.book.holds(record.session_id):
            self._follow(self.book.release(record.session_id, now))
        self._forget_freed()
        runtime_views.publish_gauges(self)

    def requeue(self, runner: Any) -> None:
        """A worker refused an assigned session before it ran, as its own state (it drains or failed, and said so
        first): back to the queue, ahead of every session created after it (``AdmissionBook.requeue_head``)."""
        session_id, now = runner.record.session_id, trio.current_time()
        self.runners.pop(session_id, None)
        self.lifecycle.requeue(runner.record)  # its room stays followed as a queued session's (never handed over)
        self._notice_failing(now)
        self._follow(self.book.requeue_head(session_id, now))
        self._forget_freed()

    def _forget_freed(self) -> None:
        """Forget the replaced workers whose last session freed its place (a few at most: one a restart)."""
        for worker_id in list(self.forget_when_free):  # one gone another way meanwhile has nothing left to forget
            self.forget_when_free.discard(worker_id)
            if worker_id in self.workers:
                self.forget_worker(self.workers[worker_id])  # noted again while it still holds a session

    # -- time ----------------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Enforce the session timeout and prune old terminal records."""
        while True:
            await trio.sleep(SWEEP_PERIOD)
            now = trio.current_time()
            expired = self.registry.expired(now)
            for record in expired:
                if record.status in RETAINING:
                    self._drain(record, DrainCause.EXPIRED)  # a no-op when an earlier cause drains it
            queued = [record for record in expired if record.status in IN_QUEUE]
            if queued:
                await self.queued_ends.end(queued, DrainCause.EXPIRED, None)
            self.registry.prune(
                now,
                retention_seconds=self.settings.terminal_retention_seconds,
                retention_count=self.settings.terminal_retention_count,
            )
            runtime_views.publish_gauges(self)

    # -- views ------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        self._notice_failing(trio.current_time())  # a worker whose service is failing is not counted healthy
        return runtime_views.health(self)

    def worker_views(self) -> list[dict[str, Any]]:
        return runtime_views.worker_views(self)

    @property
    def ready(self) -> bool:
        snapshot = self.book.snapshot()
        return self.started and not self.closing and (snapshot.workers_idle + snapshot.workers_busy) > 0

    def metadata(self) -> dict[str, Any]:
        return runtime_views.metadata(self, self.health())

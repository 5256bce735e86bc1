"""A model worker: loads the pipeline once, owns its service instance, hosts the room runners.

Loading happens off the event loop (a worker thread imports the pipeline file
and builds the service; the service's own ``running()`` builds models in its
actors' threads), so the HTTP API answers while a model loads. The worker
reports its retained-session capacity once the service is warm:
``max_sessions_per_worker=auto`` is what the service's memory report allows
(engine capacity planning), and an explicit integer only lowers it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

from engine import CapacityPlan, InsufficientMemoryError, SessionCapacityPolicy, calculate_session_capacity
from pipelines.contract import BidirectionalService, MemoryReport, PipelineContractError, ServerPushService, Service
from pipelines.contract import inputs_taken
from pipelines.error_text import error_line
from pipelines.input_checks import refused_input
from pipelines.loader import OptionsNotAccepted, load_service, offered_taken
from pipelines.offline_calls import service_failure, telling_error
from pipelines.pipeline_exits import exits_as_errors
from pipelines.validation import PipelineValidationError, validate_service

from .gpu_devices import child_visible_devices
from .process_service import ProcessService, start_process_service
from .process_service.errors import ProcessServiceFailed, ProcessServiceStartError
from .reasons import public_reason
from .requests import OptionsRefused, SessionImageRefused

__all__ = ["LoadFailure", "ModelWorker", "ModelWorkerError", "ServiceEnded"]

log = logging.getLogger("chunkline.worker")

#: Seconds the startup check (one warm-up chunk) may take once the service is up.
VALIDATION_TIMEOUT = 120.0
#: Seconds an in-process worker's load may take, from the pipeline's import to its service inside ``running()``: as
#: long as a process worker's child has for the same two steps (its start, 600 s, and entering ``running()``, 600 s;
#: :mod:`server.process_service`). Past it the worker fails (and is replaced, with backoff), as a child is killed;
#: a load that hung in a thread (a stalled download, a device that never answers) kept the worker ``loading``
#: for ever, every create a 503.
LOAD_TIMEOUT = 1200.0
#: Seconds a service whose ``failure`` is set has to leave ``running()`` by itself (as the contract has it do), looked
#: at each :data:`FAILURE_LOOK` s; past it the worker leaves it, failing with that cause. A failure said while
#: ``running()`` stayed open held a worker counted failed, its sessions streaming on, the cause said nowhere.
SERVICE_FAILURE_GRACE = 10.0
FAILURE_LOOK = 1.0


class ModelWorkerError(RuntimeError):
    """The pipeline could not be loaded or does not fit this configuration."""


class ConfigurationRefused(ModelWorkerError):
    """The pipeline cannot run with this server's settings: a replacement worker would refuse them the same way,
    so its slot is not restarted (``on_failed`` is told ``permanent=True``)."""


#: the failures a replacement worker would meet the same way: the slot is not restarted
REFUSALS = (ConfigurationRefused, OptionsNotAccepted)  # the latter raised here, or in a process worker's child


class LoadTimedOut(ModelWorkerError):
    """An in-process load passed :data:`LOAD_TIMEOUT` (its thread, if stuck in one, is left to it)."""


@attrs.frozen
class LoadFailure:
    """How a worker's load failed, before it ever took a session: the error's kind and its words. Two loads of one
    pipeline that fail alike (its module raises on import, its ``get_service()`` raises) say the next one would too."""

    kind: str
    words: str

    @classmethod
    def of(cls, exc: BaseException) -> LoadFailure | None:
        """How ``exc`` failed the load; None when that says nothing of the next load (it timed out, a child could
        not be spawned). A process worker's child is known by its own error, not the message naming its service."""
        if isinstance(exc, LoadTimedOut):
            return None
        if isinstance(exc, ProcessServiceStartError):
            return None if exc.child_error is None else cls("child process", exc.child_error)
        return cls(f"{type(exc).__module__}.{type(exc).__qualname__}", public_reason(exc))


class ServiceEnded(RuntimeError):
    """The service left its ``running()`` block without being asked to: the worker failed."""


class WorkerFault(RuntimeError):
    """Something the worker did went wrong in a way that leaves its service in doubt (a session's close that did
    not end): the worker stops and fails, so that its slot starts a fresh one."""


class ModelWorker:
    def __init__(
        self,
        worker_id: str,
        *,
        pipeline: str,
        gpu_ids: tuple[int, ...],
        max_sessions: int | str,
        on_ready: Callable[[ModelWorker, int, CapacityPlan], None],
        on_failed: Callable[..., None],  # (worker, reason, *, permanent): permanent when it refused its settings
        service_loader: Callable[..., Service] | None = None,
        policy: SessionCapacityPolicy = SessionCapacityPolicy(),
        worker_mode: str = "in-process",
        placement: str | None = None,
        offered: dict[str, Any] | None = None,
        validate: bool = False,
        new_load_failure: Callable[[LoadFailure], bool] | None = None,
    ) -> None:
        """``gpu_ids``: this worker's device group, as this process numbers its GPUs: a child process sees the
        group alone (its ``CUDA_VISIBLE_DEVICES``: :mod:`server.gpu_devices`), so the service there gets 0..n-1;
        in-process the service gets them as ``gpu_ids``. ``gpu_num`` is the group's size. ``offered``:
        server settings handed to a pipeline that names them (``control_idle_timeout``). ``validate``:
        run the startup check (one warm-up chunk, :mod:`pipelines.validation`) before taking sessions.
        ``new_load_failure``: whether a failed load is the first of its kind the server has seen; only that one's
        traceback is logged (each slot's retries, and every slot, meet the same one). None: every one is new."""
        if service_loader is None:  # "process": the service runs in a child process behind a proxy
            service_loader = start_process_service if worker_mode == "process" else load_service
        self.worker_id = worker_id
        self.pipeline = pipeline
        self.gpu_ids = gpu_ids
        self.max_sessions = max_sessions
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._load = service_loader
        self._policy = policy
        self._validate = validate
        self._options: dict[str, Any] = {} if placement is None else {"placement": placement}  # as given
        self._offered: dict[str, Any] = dict(offered or {})
        if worker_mode == "process" and service_loader is start_process_service:
            self._offered["gpu_ids"] = tuple(range(len(gpu_ids)))
            if gpu_ids:
                self._options["environment"] = {"CUDA_VISIBLE_DEVICES": child_visible_devices(gpu_ids)}
        else:
            self._offered["gpu_ids"] = tuple(gpu_ids)
        self.service: Service | None = None
        self.plan: CapacityPlan | None = None
        self.failure: str | None = None
        #: how its load failed, when it failed before it was ever ready (None for a load past its deadline, which
        #: says nothing of the next load); its slot gives up when its replacement's load fails the same way
        self.load_failure: LoadFailure | None = None
        self._new_load_failure = new_load_failure
        #: set once the worker failed (``failure`` says why); runners ending meanwhile wait for it
        self.failed = trio.Event()
        #: the startup check's outcome, for metadata: None until it ran, then passed (with the chunk's
        #: shape and fps) or skipped
        self.startup_check: dict[str, Any] | None = None
        self._runners: trio.Nursery | None = None
        # a child process bounds its own load (start_process_service); in-process, the worker does
        self._load_timeout = None if worker_mode == "process" else LOAD_TIMEOUT
        self._loaded = trio.Event()  # ready, or failed: the load is over either way
        self._stop = trio.Event()
        self._fault: str | None = None  # why fail() stopped the worker

    @property
    def failing(self) -> bool:
        """The worker failed, or its service says it did (its report comes once it has left ``running()``)."""
        return self.failure is not None or (self.service is not None and service_failure(self.service) is not None)

    @property
    def out_of_service(self) -> bool:
        """It takes no session: :attr:`failing`, or told to fail (:meth:`fail`), its service leaving ``running()``
        (which may take a while: it took sessions meanwhile, onto a service shutting down)."""
        return self._fault is not None or self.failing

    @property
    def service_says(self) -> str | None:
        """The service's own words while it says it failed and the worker has not failed yet (it leaves ``running()``
        within :data:`SERVICE_FAILURE_GRACE`); None otherwise."""
        if self.failure is not None or self.service is None or (said := service_failure(self.service)) is None:
            return None
        return said if isinstance(said, str) and said else repr(said)

    @property
    def said_failing(self) -> str | None:
        """Why the worker is failing while it has not failed yet, as a slot's reason and a refusal say it: what
        :meth:`fail` was told, or :attr:`service_says`; None otherwise."""
        if self.failure is None and self._fault is not None:
            return f"failing ({self._fault}); leaving its service"
        said = self.service_says
        return None if said is None else f"its service says it failed ({said})"

    @property
    def kind(self) -> str | None:
        return None if self.service is None else self.service.kind

    @property
    def inputs_taken(self) -> frozenset[str] | None:
        """The session inputs its pipeline's service declares it takes (``pipelines.contract.inputs_taken``); None
        until the pipeline is loaded."""
        return None if self.service is None else inputs_taken(self.service)

    @property
    def offered_taken(self) -> frozenset[str] | None:
        """The offered settings the pipeline's ``get_service`` took; None until it is loaded, or when not known."""
        return None if self.service is None else offered_taken(self.service)

    @property
    def settings_taken(self) -> dict[str, Any] | None:
        """The offered settings the pipeline's ``get_service`` took, each with the value it was given (what its
        sessions run with); None until it is loaded, or when that is not known."""
        taken = self.offered_taken
        return None if taken is None else {name: self._offered[name] for name in sorted(taken)}

    def open_runner(self, runtime: Any, record: Any) -> Any:
        """Start a room runner for an admitted session on this worker; the runtime tracks it."""
        from .runner import RoomRunner

        runner = RoomRunner(runtime.runner_deps, record, self)
        self.start_runner(runner.run)
        return runner

    def start_runner(self, run: Callable[[], Any]) -> None:
        """Run a room runner while the service is up (runners share the service instance)."""
        if self._runners is None:
            raise ModelWorkerError(f"worker {self.worker_id} is not running")
        self._runners.start_soon(run)

    def stop(self) -> None:
        self._stop.set()

    def fail(self, reason: str) -> None:
        """Leave the service and fail with ``reason`` (its slot replaces the worker, as after a crash): for what a
        runner saw go wrong that may have left the service holding what it cannot give back."""
        if self._fault is None and not self._stop.is_set():
            # it takes no session from now on (``out_of_service``), though its service may take a while to leave
            log.error("worker %s is failing: %s; it takes no more sessions and leaves its service", self.worker_id,
                      reason)
            self._fault = reason
            self._stop.set()

    def end_service_process_now(self) -> None:
        """For a server about to end at once (a second signal): a service in a process of its own goes now, with
        its shared memory (its parent-death signal would end it and leave that in /dev/shm)."""
        if isinstance(self.service, ProcessService):
            self.service.kill_now()

    async def check_options(self, options: dict[str, Any], image_size: tuple[int, int] | None = None) -> None:
        """The service's own checks of a session's options and, when given, its image's size (width, height), in one
        call to a service in a process of its own; a refusal is an :class:`OptionsRefused` or a
        :class:`SessionImageRefused`.

        Only for a ready worker (its service is inside ``running()``); the caller bounds the wait.
        """
        service = self.service
        if service is None or self._runners is None:
            raise ModelWorkerError(f"worker {self.worker_id} is not running")
        if isinstance(service, ProcessService):
            refused = await service.refused_input(options, image_size)
        else:  # a check that raises other than ValueError: PipelineContractError naming it, the pipeline's bug
            refused = await refused_input(service, options, image_size)
        if refused is not None:
            what, reason = refused
            error = SessionImageRefused if what == "image" else OptionsRefused
            raise error(public_reason(reason, prefix_type=False))

    async def run(self) -> None:
        """Load, warm up, report capacity, host runners until stopped; report failure instead of raising."""
        async with trio.open_nursery() as watching:
            with trio.CancelScope() as serving:
                if self._load_timeout is not None:
                    watching.start_soon(self._bound_the_load, self._load_timeout, serving)
                try:  # inside the nursery: its error group would hide the failure's kind (a refusal is not retried)
                    with exits_as_errors():  # the pipeline's sys.exit() (in running()) left the worker "starting"
                        await self._serve()
                except Exception as exc:
                    self._failed(exc)
            watching.cancel_scope.cancel(reason="the worker stopped")

    async def _bound_the_load(self, seconds: float, serving: trio.CancelScope) -> None:
        with trio.move_on_after(seconds):
            await self._loaded.wait()
            return
        self._failed(LoadTimedOut(f"the pipeline did not load within {seconds:g} s"))
        serving.cancel(reason="the pipeline did not load in time")  # a load stuck in a thread is left to it

    def _failed(self, exc: BaseException) -> None:
        if self.failed.is_set():  # a load given up on that ended later, its way out reported already
            log.info("worker %s, after its failure: %s", self.worker_id, public_reason(exc))
            return
        loading = not self._loaded.is_set()  # it never became ready: its load (or startup check) failed
        self._loaded.set()
        # several errors at once (a nursery of the pipeline's own in running()): the one that says why, or each named;
        # health read only "ExceptionGroup: Exceptions from Trio nursery (2 sub-exceptions)"
        exc = telling_error(exc, (*REFUSALS, WorkerFault, LoadTimedOut, PipelineValidationError, PipelineContractError))
        reason = public_reason(exc)  # health and metadata show this line, cut short; the log has the detail
        # the log's line: every word of the error (a refused placement's was cut before it named the stage and the
        # fault), up to the child's traceback some carry in their words (one follows as the log's own, where due)
        detail = error_line(exc).partition(" --- child traceback --- ")[0]
        self.failure = reason
        refused = isinstance(exc, REFUSALS)  # a setting the pipeline refuses: the reason says it all, no traceback
        # and so does a fault a runner saw, and a pipeline file Python cannot read (its line names the file and line;
        # the traceback was 40 lines of the loader's and trio's thread's)
        # and a service child that died (its line says how; the traceback was the proxy's and trio's internals)
        explained = (refused or isinstance(exc, WorkerFault | ProcessServiceFailed)
                     or isinstance(exc.__cause__, SyntaxError))
        if loading:
            self.load_failure = LoadFailure.of(exc)
        if self.load_failure is not None and not self._is_new(self.load_failure):
            # told already, traceback and all: its slot's line says what comes of it
            log.debug("worker %s could not load the pipeline %r (as before): %s", self.worker_id, self.pipeline, reason)
        elif loading:
            log.error("worker %s could not load the pipeline %r: %s", self.worker_id, self.pipeline, detail,
                      exc_info=None if explained else exc)
        else:
            log.error("worker %s failed: %s", self.worker_id, detail, exc_info=None if explained else exc)
        # a replacement would refuse these settings, or be refused them, the same way: not restarted
        self._on_failed(self, reason, permanent=refused)
        self.failed.set()

    def _is_new(self, failure: LoadFailure) -> bool:
        return self._new_load_failure is None or self._new_load_failure(failure)

    async def _serve(self) -> None:
        loader = partial(self._load, self.pipeline, gpu_num=len(self.gpu_ids), offered=self._offered, **self._options)
        # in-process, a load past its deadline is given up on at once (its thread left to it)
        service = await trio.to_thread.run_sync(loader, abandon_on_cancel=self._load_timeout is not None)
        self.service = service
        limit = self.max_sessions if isinstance(self.max_sessions, int) else None
        if isinstance(service, ServerPushService) and limit not in (None, 1):
            close = getattr(service, "close", None)  # a service in a child process: stop the child
            if close is not None:
                await trio.to_thread.run_sync(close)
            raise ConfigurationRefused(
                f"a ServerPushService holds exactly one retained session; max_sessions_per_worker={limit} is refused"
            )
        if isinstance(service, BidirectionalService):
            service.configure_session_capacity(limit or self._policy.max_capacity)
        # the runners live outside the service's running(): when the service fails as a whole, they are
        # told the cause (on_failed fails them) and end as failures, rather than being cancelled with it
        async with trio.open_nursery() as runners:
            try:
                with exits_as_errors("running()"):  # it fails the worker, telling its runners, as an error does
                    async with service.running():
                        await self._check(service)
                        self.plan = self._capacity_plan(service, limit)
                        self._runners = runners
                        self._loaded.set()
                        self._on_ready(self, self.plan.effective_capacity, self.plan)
                        await self._until_stopped()
                if self._fault is not None:
                    raise WorkerFault(self._fault)
                if not self._stop.is_set():
                    raise ServiceEnded("the service stopped by itself")
            except Exception as exc:
                self._runners = None
                self._failed(exc)  # the runners fail with the cause; the nursery waits for their bounded ends
                return
            self._runners = None
            runners.cancel_scope.cancel()

    async def _until_stopped(self) -> None:
        """Until the worker is stopped; a service that says it failed and stays in ``running()`` past
        :data:`SERVICE_FAILURE_GRACE` is left, the worker failing with the service's words."""
        said_since: float | None = None
        while not self._stop.is_set():
            with trio.move_on_after(FAILURE_LOOK):
                await self._stop.wait()
            said, now = self.service_says, trio.current_time()
            said_since = None if said is None else now if said_since is None else said_since
            if said_since is not None and now - said_since >= SERVICE_FAILURE_GRACE:
                self.fail(f"the service failed ({said}); it had not left running() {SERVICE_FAILURE_GRACE:g} s on")

    async def _check(self, service: Service) -> None:
        """The startup check (one warm-up chunk against the contract) unless validation is skipped."""
        if not self._validate:
            self.startup_check = {"status": "skipped"}
            return
        chunk = await validate_service(service, timeout=VALIDATION_TIMEOUT)
        self.startup_check = {"status": "passed", "frames": list(chunk.frames.shape), "fps": chunk.fps}

    def _capacity_plan(self, service: Service, limit: int | None) -> CapacityPlan:
        if isinstance(service, ServerPushService):
            return CapacityPlan(computed_capacity=None, effective_capacity=1, configured_limit=1, limiting_device=None)
        report = service.memory_report()
        if report is not None and not isinstance(report, MemoryReport):  # (it failed the load in Python's words)
            raise PipelineContractError(f"memory_report() returned {type(report).__name__}, not a "
                                        f"pipelines.contract.MemoryReport (or None)")
        if report is None:
            return calculate_session_capacity([], {}, limit if limit is not None else 1, policy=self._policy)
        try:
            return calculate_session_capacity(
                report.snapshots,
                report.role_budgets,
                limit,
                untracked_bytes_per_session=report.untracked_bytes_per_session,
                policy=self._policy,
            )
        except InsufficientMemoryError as exc:
            raise ModelWorkerError(str(exc)) from exc

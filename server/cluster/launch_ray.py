"""``--workers ray``: Ray places and supervises the agents; it never routes a session.

Per worker slot: one placement group (one bundle: the slot's GPU count, or one CPU when it has
none) and one thin synchronous actor in it (``max_restarts=0``, owned by this process, so both
die with the authority). The actor starts the agent process with the devices Ray assigned
(``CUDA_VISIBLE_DEVICES`` and ``--devices``) and the node's id as its node name; the agent
process dies with the actor (``PR_SET_PDEATHSIG``). A thread waits on each actor's ``run``
result and posts its end into trio: a clean exit, an agent's exit code, or Ray's death notice
(the actor died) — the authority loses the slot's worker with that cause, the placement group
is removed, and the slot starts again after the shared restart policy's backoff
(:mod:`states.restart_policy`), giving up after a crash loop. A placement group that waits for
resources (every node full, a node gone) is not a failure: the slot waits, placing, until Ray
finds room (a node joins, another slot drains).

Ray's asyncio actors do not mix with trio (ray issue 7228); the actor here is synchronous and
the authority talks to Ray only from threads.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from pipelines.error_text import error_line
from states.liveness import PROCESS_GONE, loss_kind
from states.restart_policy import RestartPolicy, RestartTracker
from states.stream_session import DrainCause

from .backoff import EXIT_REFUSED, await_goodbye, back_off, stays_down
from .launch_local import agent_command, exit_cause
from .launcher_slots import SlotLauncher
from .load_failures import LOAD_FAILURE_ENV, read_load_failure, write_load_failure

if TYPE_CHECKING:
    from ..model_worker import LoadFailure
    from . import wire
    from .authority import ClusterAuthority
    from .remote import RemoteWorker

__all__ = ["RayLauncher", "AgentActor"]

log = logging.getLogger("chunkline.cluster")

PLACEMENT_TIMEOUT = 60.0  # seconds a placed actor may take to answer (its worker process starting)
PLACEMENT_POLL = 1.0  # seconds between looks at a pending placement group
PLACEMENT_NOTICE = 10.0  # seconds a slot may wait for Ray to place its agent before the log says what it waits for
NAMESPACE = "chunkline"
QUIET_SIGNALS_ENV = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"  # Ray's crash reports on signals, off in the server


class AgentActor:
    """Runs one agent process where Ray placed this actor; ``run`` returns its exit code and, when its pipeline never
    loaded, how its load failed (:mod:`server.cluster.load_failures`: the file lives on the actor's node)."""

    def __init__(self) -> None:
        self.process: Any = None

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()[:12]

    def run(self, command: list[str], env: dict[str, str], cwd: str,
            told: LoadFailure | None = None) -> tuple[int, LoadFailure | None]:
        """``told``: how the slot's last agent failed its load (the agent then logs a repeat without its traceback)."""
        import ctypes
        import signal
        import subprocess

        import ray

        from server.server_folders import ServerFolder  # in the actor's process

        gpus = [str(int(g)) for g in ray.get_gpu_ids()]
        env = dict(env)
        command = [*command, "--node", self.node()]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            command += ["--devices", ",".join(gpus)]

        def die_with_the_actor() -> None:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

        folder = ServerFolder("ray")  # the actor's own, named by its process id: a killed actor's goes at the next
        notes = folder.make()
        try:
            env[LOAD_FAILURE_ENV] = path = os.path.join(notes, "load-failure.json")
            if told is not None:
                write_load_failure(path, told)
            self.process = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                            preexec_fn=die_with_the_actor)
            return self.process.wait(), read_load_failure(path)
        finally:
            folder.remove()


@attrs.define(eq=False)
class _RaySlot:
    name: str
    gpus: int
    restarts: RestartTracker
    worker_id: str | None = None
    settled: trio.Event = attrs.Factory(trio.Event)  # its registered worker left or was lost
    drained: bool = False
    ended: str | None = None  # how its last agent ended, from the launcher's notice until it is placed again
    load_failure: LoadFailure | None = None  # how its last agent failed its load, when it never loaded
    node: str | None = None
    actor: Any = None
    group: Any = None


class RayLauncher(SlotLauncher):
    name = "ray"

    def __init__(self, groups: Sequence[tuple[int, ...]], *, address: str | None,
                 policy: RestartPolicy | None = None) -> None:
        self.slots = [_RaySlot(str(i), len(g), RestartTracker(policy)) for i, g in enumerate(groups)]
        self.expected = len(self.slots)
        self.address = address
        self._authority: ClusterAuthority | None = None
        self._actor_class: Any = None

    async def run(self, authority: ClusterAuthority, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # SIGTERM is the server's drain: Ray's driver would print a crash report for it first (``*** SIGTERM received
        # ...`` and a stack), which read as a crash. Ray reads this as it is imported; a user's own setting stands
        os.environ.setdefault(QUIET_SIGNALS_ENV, "1")
        import ray

        self._authority = authority
        # the server starts serving while Ray connects (its slots are starting): Ray's connect to an address where
        # nothing answers goes on for minutes, and the server's start waited for it, deaf to a stop until hypercorn
        # gave up on the start (a traceback); a stop now leaves the connect behind, the process on its way out
        task_status.started()
        where = self.address or "a new local Ray"
        log.info("cluster: connecting to Ray at %s", where)
        logging.getLogger("ray._private.worker").addFilter(_no_sigterm_handler_warning)
        try:
            await trio.to_thread.run_sync(
                partial(ray.init, address=self.address, namespace=NAMESPACE, include_dashboard=False,
                        log_to_driver=True, ignore_reinit_error=True, configure_logging=False),
                abandon_on_cancel=True,
            )
        except Exception as exc:  # every slot gives up, saying why (health, the queued sessions' end)
            self._unreachable(f"could not connect to Ray at {where}: {error_line(exc)}")
            return
        log.info("cluster: connected to Ray")
        self._actor_class = ray.remote(max_restarts=0, max_concurrency=2)(AgentActor)
        try:
            async with trio.open_nursery() as nursery:
                for slot in self.slots:
                    nursery.start_soon(self._keep, slot)
        finally:
            with trio.CancelScope(shield=True):
                for slot in self.slots:
                    await trio.to_thread.run_sync(self._release, slot)
                await trio.to_thread.run_sync(ray.shutdown)

    def _unreachable(self, why: str) -> None:
        log.error("cluster: %s; no agent is placed", why)
        for slot in self.slots:
            slot.restarts.failure(trio.current_time(), why, permanent=True)
            stays_down(self._authority, slot.restarts, f"ray slot {slot.name}", DrainCause.WORKER_FAILED)

    def _command(self) -> list[str]:
        assert self._authority is not None
        settings = self._authority.runtime.settings
        return agent_command(
            os.path.abspath(settings.pipeline), self._authority.authority_url, devices=(), launcher=self.name,
            slot="", max_sessions=settings.max_sessions_per_worker, worker_mode=settings.worker_mode,
            placement=settings.placement, control_idle_timeout=settings.control_idle_timeout,
            default_fps=settings.default_fps, skip_validation=settings.skip_validation,
            tls_certificate=settings.cluster_tls_cert,
        )

    def _request(self, slot: _RaySlot) -> Any:
        """Blocking (a thread): ask Ray for the slot's placement group (one bundle, on one node)."""
        from ray.util.placement_group import placement_group

        slot.group = placement_group([self._bundle(slot)], strategy="STRICT_PACK")
        return slot.group.ready()

    @staticmethod
    def _bundle(slot: _RaySlot) -> dict[str, int]:
        """What the slot's agent asks of one node: its GPU group, or a CPU."""
        return {"GPU": slot.gpus} if slot.gpus else {"CPU": 1}

    @staticmethod
    def _placed(ready: Any) -> bool:
        """Blocking (a thread, at most PLACEMENT_POLL): whether the placement group is placed."""
        import ray

        done, _ = ray.wait([ready], timeout=PLACEMENT_POLL)
        return bool(done)

    def _start(self, slot: _RaySlot) -> Any:
        """Blocking (a thread): the slot's actor in its placed group, then its ``run`` reference."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=slot.group, placement_group_bundle_index=0)
        slot.actor = self._actor_class.options(
            num_gpus=slot.gpus, num_cpus=0 if slot.gpus else 1, scheduling_strategy=strategy
        ).remote()
        slot.node = ray.get(slot.actor.node.remote(), timeout=PLACEMENT_TIMEOUT)
        assert self._authority is not None
        command = self._command()
        command[command.index("--slot") + 1] = slot.name
        env = dict(os.environ, CHUNKLINE_CLUSTER_TOKEN=self._authority.token)
        return slot.actor.run.remote(command, env, os.getcwd(), slot.load_failure)

    @staticmethod
    def _outcome(reference: Any) -> tuple[str, int | None, LoadFailure | None]:
        """Blocking (a thread): how the slot's actor ended, its agent's exit code (None: the node went) and how its
        load failed (None: it loaded, or ended otherwise)."""
        import ray

        try:
            code, failure = ray.get(reference)
        except ray.exceptions.RayActorError as exc:  # Ray's word: the actor died (its node may live on)
            return f"actor died ({type(exc).__name__})", None, None
        except ray.exceptions.RayError as exc:  # the result is lost: that says nothing of the actor or its node
            return f"actor unreachable: Ray raised {type(exc).__name__}", None, None
        return exit_cause(code), code, failure

    def _release(self, slot: _RaySlot) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception as exc:  # the actor's node may be gone already
                log.debug("ray slot %s: kill: %s", slot.name, exc)
            slot.actor = None
        if slot.group is not None:
            try:
                remove_placement_group(slot.group)
            except Exception as exc:
                log.debug("ray slot %s: remove placement group: %s", slot.name, exc)
            slot.group = None

    async def _keep(self, slot: _RaySlot) -> None:
        """Place the slot's actor, wait for its end, release it, and place it again after the backoff."""
        import ray

        while True:
            slot.ended = None
            try:
                ready = await trio.to_thread.run_sync(self._request, slot)
                asked, told = trio.current_time(), False
                while not await trio.to_thread.run_sync(self._placed, ready, abandon_on_cancel=True):
                    # pending: waits for room, not a failure; but said, or the server is unhealthy without a word
                    if not told and trio.current_time() - asked >= PLACEMENT_NOTICE:
                        told = True
                        log.warning("ray slot %s: Ray has not placed its agent in %g s: it needs %s on one node, which "
                                    "no node has free now (`ray status` shows the cluster's); it starts once one has",
                                    slot.name, PLACEMENT_NOTICE, self._bundle(slot))
                if told:
                    log.info("ray slot %s: placed after %.0f s", slot.name, trio.current_time() - asked)
                reference = await trio.to_thread.run_sync(self._start, slot, abandon_on_cancel=True)
            except ray.exceptions.RayError as exc:
                why, code, failure = f"placement failed: {type(exc).__name__}: {exc}", None, None
            else:
                why, code, failure = await trio.to_thread.run_sync(self._outcome, reference, abandon_on_cancel=True)
            slot.ended = why
            if slot.worker_id is not None:
                await await_goodbye(slot.settled, code == 0)
            if slot.worker_id is not None and self._authority is not None:
                self._authority.lose(slot.worker_id, why)
            slot.worker_id = None
            await trio.to_thread.run_sync(self._release, slot)
            slot.node = None
            if slot.drained and code == 0:
                slot.restarts.stop()  # drained on purpose: its resources are back in Ray, nothing to replace
                log.info("ray slot %s: drained; it stays down", slot.name)
                stays_down(self._authority, slot.restarts, f"ray slot {slot.name}")
                return
            slot.load_failure = failure  # a repeat gives the slot up (states.restart_policy), as in-process
            settings = None if self._authority is None else self._authority.runtime.settings
            if not await back_off(slot.restarts, why, f"ray slot {slot.name}", permanent=code == EXIT_REFUSED,
                                  load_failure=failure, pipeline=None if settings is None else settings.pipeline):
                stays_down(self._authority, slot.restarts, f"ray slot {slot.name}", DrainCause.WORKER_FAILED)
                return
            if self._authority is not None:
                self._authority.runtime.metrics.record_worker_restart()

    # -- the authority's notices --

    def refusal(self, register: wire.Register) -> str | None:
        """Ray's agents are told their actor, not a pid of this process: none is refused here."""
        return None

    def worker_registered(self, worker: RemoteWorker) -> None:
        slot = self.slot_of(worker)
        if slot is not None:
            slot.restarts.loaded()  # an agent registers once it loaded: later failures are crashes, backed off
            slot.worker_id = worker.worker_id
            slot.settled = trio.Event()

    def worker_lost(self, worker: RemoteWorker, cause: str) -> None:
        slot = self.slot_of(worker)
        if slot is not None and slot.worker_id == worker.worker_id:
            slot.worker_id = None
            slot.settled.set()
            if slot.actor is not None and loss_kind(cause) not in PROCESS_GONE:
                # lost while its process may live on (frozen, cut off): end the actor, the slot is replaced
                actor, slot.actor = slot.actor, None
                trio.lowlevel.spawn_system_task(trio.to_thread.run_sync, partial(_kill, actor))

    def view(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        return [{"slot": s.name, "gpus": s.gpus, "state": s.restarts.state.value, "placed": s.node is not None,
                 "worker_id": s.worker_id, "node": s.node, "ended": s.ended, "restarts": s.restarts.restarts,
                 "reason": s.restarts.describe(now)} for s in self.slots]


def _no_sigterm_handler_warning(record: logging.LogRecord) -> bool:
    """Leave out Ray's warning that its connect, on a thread, put no SIGTERM handler in: the server keeps its own
    (Ray's, in the main thread, would end the process at a SIGTERM with no drain)."""
    return "SIGTERM handler is not set" not in record.getMessage()


def _kill(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:
        log.debug("ray: kill: %s", exc)


if sys.platform != "linux":  # pragma: no cover - PR_SET_PDEATHSIG is Linux only
    raise ImportError("--workers ray needs Linux (agent processes die with their actor through PR_SET_PDEATHSIG)")

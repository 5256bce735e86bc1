"""What the stream runtime shows: health, per-worker views, service metadata and the metrics gauges.

Read-only: each function reads the runtime's book, registry, runners and slots and
builds the JSON the HTTP API returns (or the gauges it publishes); none of them moves a
session or a worker.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import trio

from pipelines.contract import SESSION_INPUTS, BidirectionalService
from states.stream_session import LIVE_MEDIA
from states.worker import ELIGIBLE as ELIGIBLE_WORKERS
from states.worker import TERMINAL as WORKER_TERMINAL
from states.worker import State as WorkerState

from .cluster.wire_values import SESSION_SETTINGS
from .model_worker import ModelWorker

if TYPE_CHECKING:
    from .runtime import StreamRuntime

__all__ = ["control_idle_timeout_in_force", "current_worker_views", "health", "metadata", "own_settings",
           "publish_gauges", "services_said_failed", "session_inputs_taken", "settings_in_force", "worker_counts",
           "worker_views"]


def current_worker_views(runtime: StreamRuntime) -> list[Any]:
    """The book's views of the workers that fill a place now: each in-process slot's current worker and every
    agent. A failed worker its slot has replaced is history (its failure stays in metadata's ``worker_failures``):
    counted, it made ``workers_total`` grow with each restart, one slot showing as two workers, then three."""
    def current(worker_id: str) -> bool:
        worker = runtime.workers.get(worker_id)
        return not isinstance(worker, ModelWorker) or runtime.slots.holding(worker) is not None

    return [view for view in runtime.book.workers() if current(view.worker_id)]


def services_said_failed(runtime: StreamRuntime) -> str:
    """For a 503: the workers whose service says it failed before they have (a 503 had said nothing of it)."""
    said = ((wid, w.said_failing) for wid, w in runtime.workers.items() if isinstance(w, ModelWorker))  # not agents
    return "; ".join(f"{worker_id}: {words}" for worker_id, words in said if words)


def worker_counts(runtime: StreamRuntime) -> dict[str, int]:
    """The current workers by state; ``total`` is their sum (starting + idle + busy + draining + failed +
    stopped)."""
    counts = dict.fromkeys((state.value for state in WorkerState), 0)
    for view in current_worker_views(runtime):
        counts[view.state.value] += 1
    return {"total": sum(counts.values()), **counts}


def publish_gauges(runtime: StreamRuntime) -> None:
    """Session, queue, worker and capacity gauges from the book and the registry."""
    snapshot = runtime.book.snapshot()
    metrics = runtime.metrics
    metrics.set_sessions(runtime.registry.counts())
    metrics.set_queue_depth(snapshot.queued)
    counts = worker_counts(runtime)  # as health counts them: a replaced worker is not counted failed
    # every state health counts: without draining and stopped, a drained worker vanished from the gauge's sum
    metrics.set_workers({state.value: counts[state.value] for state in WorkerState})
    metrics.set_capacity(sum(w.capacity for w in runtime.book.workers() if w.state in ELIGIBLE_WORKERS))


def health(runtime: StreamRuntime) -> dict[str, Any]:
    """``GET /v1/service/health``: healthy, degraded or unhealthy, with the counts behind it."""
    book = runtime.book
    snapshot = book.snapshot()
    counts = worker_counts(runtime)
    live = counts["total"] - counts["failed"] - counts["stopped"]
    # the seed's definition, made true: a runner whose worker is in its room with media (the state alone counted a
    # session draining whose worker never joined, and an agent that never joined its room)
    connected = any(r.record.status in LIVE_MEDIA and r.in_room_with_media for r in runtime.runners.values())
    # a failed worker that its slot has replaced is history (counted in workers_failed), not a degradation
    failed_now = sum(
        1 for slot in runtime.slots
        if slot.worker is None or book.worker_state(slot.worker.worker_id) in WORKER_TERMINAL
    )
    # agents: fewer eligible than the launcher expects is a degradation (a lost agent leaves the book)
    cluster = runtime.cluster
    now = trio.current_time()
    # a launcher's slots restart their agents as in-process slots restart their workers: counted alike
    launched = cluster.launcher.view() if cluster is not None and cluster.launcher is not None else []
    launched_slots = {  # (none without a cluster: launched is empty then)
        f"{cluster.launcher_name}-{s['slot']}": {key: s[key] for key in ("worker_id", "restarts", "state", "reason")}
        for s in launched
    }
    short = cluster is not None and counts["idle"] + counts["busy"] < cluster.expected
    if live == 0:
        status = "unhealthy"
    elif failed_now or counts["starting"] or short:
        status = "degraded"
    else:
        status = "healthy"
    return {
        "status": status,
        "transport": runtime.transport.name,
        "transport_connected": connected,
        "livekit_connected": connected,  # the seed's name, kept as an alias of transport_connected
        # one per worker place (slot or agent), never a replaced worker: total = starting + idle + busy +
        # draining + failed + stopped
        **{f"workers_{name}": count for name, count in counts.items()},
        "queued_sessions": snapshot.queued,
        "worker_restarts": runtime.slots.restarts + sum(s["restarts"] for s in launched),
        "worker_slots": {**runtime.slots.status(now), **launched_slots},
        "retained_sessions": snapshot.retained,
        # shutting down, no create is taken: a load balancer reading free slots sent creates on to their 429
        "shutting_down": runtime.closing,
        "free_slots": 0 if runtime.closing else snapshot.free_slots,
        "workers": worker_views(runtime),
    }


def worker_views(runtime: StreamRuntime) -> list[dict[str, Any]]:
    """One entry per current worker (the ones health counts): id, node, devices, state, capacity, retained,
    heartbeat age, launcher."""
    now = trio.current_time()
    out = []
    for view in current_worker_views(runtime):
        worker = runtime.workers.get(view.worker_id)
        entry: dict[str, Any] = {
            "worker_id": view.worker_id,
            "state": view.state.value,
            "capacity": view.capacity,
            "retained": view.retained,
            "node": socket.gethostname(),
            "devices": list(getattr(worker, "gpu_ids", ())),
            "heartbeat_age": None,
            "launcher": "in-process",
            **own_settings(runtime, worker),
        }
        if runtime.cluster is not None:
            entry.update(runtime.cluster.view(view.worker_id, now) or {})
        out.append(entry)
    return out


def own_settings(runtime: StreamRuntime, worker: Any) -> dict[str, Any]:
    """A worker's ``worker_mode`` and configured session limit (``configured_max_sessions``: a number, or ``auto``):
    an in-process worker runs with this server's settings; an agent with its own mode, from its Ready, and the lower of
    its own limit (its plan's) and this server's ``--max-sessions-per-worker``, which holds every agent (None until it
    said). An external agent is started with its own flags: it showed this server's."""
    if isinstance(worker, ModelWorker):
        return _server_settings(runtime)
    if worker is None or worker.plan is None:
        return {"worker_mode": None if worker is None else worker.worker_mode, "configured_max_sessions": None}
    held = runtime.settings.max_sessions_per_worker
    limits = [n for n in (worker.plan.to_dict()["configured_limit"], held) if isinstance(n, int)]
    return {"worker_mode": worker.worker_mode, "configured_max_sessions": min(limits) if limits else "auto"}


def _server_settings(runtime: StreamRuntime) -> dict[str, Any]:
    settings = runtime.settings
    return {"worker_mode": settings.worker_mode, "configured_max_sessions": settings.max_sessions_per_worker}


def settings_in_force(runtime: StreamRuntime, name: str) -> Any:
    """``name`` of :func:`own_settings` as the workers run with it: this server's setting without agents; with agents,
    the one value every agent that said has, else None (none said yet, or they differ: ``workers`` names each)."""
    if runtime.cluster is None:
        return _server_settings(runtime)[name]
    said = {value for worker in runtime.workers.values() if (value := own_settings(runtime, worker)[name]) is not None}
    return said.pop() if len(said) == 1 else None


def control_idle_timeout_in_force(workers: Iterable[Any]) -> float | None:
    """The ``control_idle_timeout`` the loaded workers' pipelines run with: the value each of them was handed (an
    agent's own, which may differ from this server's setting), when all took it and one value; else None: no
    worker has loaded the pipeline, one does not apply the setting (a server-push pipeline; a ``get_service`` that
    does not take it; a worker that cannot say what its pipeline took is not claimed to), or they differ (then
    ``worker_settings`` names each)."""
    values = set()
    for worker in workers:
        if worker.kind is None:
            continue
        taken = getattr(worker, "settings_taken", None) or {}
        if worker.kind != BidirectionalService.kind or "control_idle_timeout" not in taken:
            return None
        values.add(taken["control_idle_timeout"])
    return values.pop() if len(values) == 1 else None


def session_inputs_taken(workers: Iterable[Any]) -> list[str] | None:
    """The session inputs (``prompt``, ``image``) a create may give, as the workers' pipeline declares them, so that a
    client learns it before a 400 tells it; None while no worker has loaded the pipeline. An input is listed only when
    every worker that has said takes it, the rule by which a create is checked (:mod:`server.session_inputs`)."""
    declared = [taken for worker in workers if (taken := worker.inputs_taken) is not None]
    if not declared:
        return None
    return [name for name in SESSION_INPUTS if all(name in taken for taken in declared)]


def _worker_settings(workers: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per worker, the shown settings its pipeline took, with the values it runs with."""
    shown = {}
    for worker in workers:
        taken = getattr(worker, "settings_taken", None) or {}
        if any(name in taken for name in SESSION_SETTINGS):
            shown[worker.worker_id] = {name: taken[name] for name in SESSION_SETTINGS if name in taken}
    return shown


def metadata(runtime: StreamRuntime, health_view: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/service/metadata``: the settings that shape sessions, the workers' plans, and ``health_view``."""
    settings = runtime.settings
    workers = runtime.workers.values()
    capacities = {worker.worker_id: worker.plan.to_dict() for worker in workers if worker.plan is not None}
    kinds = {w.kind for w in workers if w.kind is not None}
    cluster = runtime.cluster
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    return {
        "service_type": "stream",
        "transport": runtime.transport.name,
        "pipeline_file": settings.pipeline,
        "pipeline_kind": kind,
        "livekit_url": settings.livekit_url,
        "num_workers": settings.num_workers,
        # the workers' own: an agent's, which may differ from this server's (null while none said, or they differ)
        "worker_mode": settings_in_force(runtime, "worker_mode"),
        "max_sessions_per_worker": min((w.capacity for w in runtime.book.workers()), default=None),
        "configured_max_sessions_per_worker": settings_in_force(runtime, "configured_max_sessions"),
        "queue_size": settings.queue_size,
        # only where it applies: null for a server-push stream, and until a worker has loaded the pipeline
        "control_idle_timeout": control_idle_timeout_in_force(workers),
        "worker_settings": _worker_settings(workers),
        "session_inputs": session_inputs_taken(workers),
        "session_timeout": settings.session_timeout,
        "controller_timeout": settings.controller_timeout,
        "room_empty_timeout": settings.room_empty_timeout,
        "token_ttl": settings.token_ttl,
        "worker_failures": {w.worker_id: w.failure for w in workers if w.failure},
        "startup_check": {w.worker_id: w.startup_check for w in workers if w.startup_check},
        "workers_launcher": settings.workers,
        "cluster": None if cluster is None else {
            **cluster.summary(),
            "slots": cluster.launcher.view() if cluster.launcher is not None else [],
        },
        "session_capacity": capacities,
        **health_view,
    }

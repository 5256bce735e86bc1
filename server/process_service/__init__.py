"""A pipeline service in a child process, behind a proxy with the same contract.

``worker-mode process`` runs each model worker's service in its own
*spawn* child, so the API process never imports the model (torch, say)::

    service = start_process_service("pipelines/toy_world", gpu_num=1)  # blocking: run it in a thread
    service.configure_session_capacity(4)      # optional, before running()
    async with service.running():              # the child enters the service's running()
        report = service.memory_report()       # taken by the child once running
        sid = await service.create_session(SessionConfig(), on_event=print)
        await service.push_control(sid, Control(ControlType.CONTROL_STATE, keys={"w"}))
        async for chunk in service.chunks(sid):
            ...

:func:`start_process_service` spawns the child, which loads the pipeline with
:func:`pipelines.loader.load_service` and reports its kind; it returns a
:class:`ProcessBidirectionalService` or a :class:`ProcessServerPushService`
(both :class:`ProcessService` s, and instances of the matching contract class).
The package's parts:

- :mod:`~server.process_service.proxy`: the proxies (the parent's side of every
  call and chunk stream; the lifecycle table is :mod:`states.service_child`);
- :mod:`~server.process_service.stream`: the parent's end of one chunk stream;
- :mod:`~server.process_service.link`: the child's supervisor (the shared
  :class:`engine.supervisor.Supervisor`: spawn from a monitor thread, parent-death
  signal and watchdog, bounded stop, reap) and delivery of its messages into trio;
- :mod:`~server.process_service.child`: the child process itself;
- :mod:`~server.process_service.wire`: the messages, as attrs classes.

Once ``running()`` is entered, every message is handed to the trio run that
entered it (through its trio token); all proxy state lives on that trio thread.

Failure: when the child dies or its pipe closes unexpectedly, within a fraction
of a second every pending call and chunk stream, and every later call, fails
with :class:`ProcessServiceFailed` ("... exited unexpectedly with code N"), the
body of ``running()`` is cancelled and ``running()`` raises that error (as an
in-process service's ``running()`` raises when its actors die).
``ControlRejected`` raised in the child is raised again as ``ControlRejected``
with the same reason, and ``PipelineContractError`` (a pipeline bug) with the
same detail, the child's traceback as a note; any other exception as
:class:`RemoteServiceError` carrying the child's traceback text. The child checks
each chunk before it goes (``ChunkOrder``; that it pickles, with nothing of the
pipeline file's own module, which the parent could not unpickle), so a stream
that yields what is not a chunk fails that stream naming the pipeline's bug,
not the whole service with an unreadable message. Every value of the
pipeline's (a chunk, a call's result, an event) travels pickled apart from its
message (:class:`~server.process_service.wire.Sealed`), so one the parent cannot
load (a module only the child has, a ``__setstate__`` that raises) fails only its
call, its stream or (an event) its session's chunks, as a pipeline bug naming
what did not load. A session stays the child's until the parent has taken its
id: one whose id does not load here, cannot be sent, or whose caller gave up
(cancelled, past its deadline) is closed by the child itself, with its own value.

Chunk streams are credit-based: the child pulls at most ``CREDIT_WINDOW``
chunks ahead of what the parent's consumer has taken, so a slow consumer holds
the service back instead of letting chunks pile up.

Closing is bounded: leaving ``running()`` (or :meth:`ProcessService.close`)
asks the child to leave the service's ``running()`` and exit, then after
``close_timeout`` seconds terminates it, then kills it ``kill_grace`` later
(the child ignores SIGTERM, as it does a stop signal to the whole process
group: SIGKILL ends it); it returns once the child is reaped and every pipe is closed.

Every call waits for the child's answer for at most its own deadline (:class:`CallDeadlines`: entering
``running()``, ``create_session``, ``push_control``, ``close_session``; ``call_deadlines=`` of
:func:`start_process_service`); past it the call is cancelled in the child and fails with
:class:`ProcessServiceCallTimeout`, naming the call and the deadline, while the service keeps running.

A child that stops answering is declared failed: its trio loop sends a heartbeat every second, and one
that is silent for ``heartbeat_timeout`` seconds (:data:`HEARTBEAT_TIMEOUT`; a frozen process, a loop
blocked by a call) is killed, so every pending call and stream fails with that cause at once.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

from pipelines.contract import BidirectionalService, ServerPushService
from pipelines.loader import record_offered_taken

from .deadlines import CallDeadlines
from .errors import (
    ProcessServiceCallTimeout,
    ProcessServiceClosed,
    ProcessServiceError,
    ProcessServiceFailed,
    ProcessServiceOptionsRefused,
    ProcessServiceStartError,
    RemoteServiceError,
)
from .link import ServiceLink
from .proxy import ProcessBidirectionalService, ProcessServerPushService, ProcessService
from .wire import CREDIT_WINDOW

__all__ = [
    "CREDIT_WINDOW",
    "HEARTBEAT_TIMEOUT",
    "CallDeadlines",
    "ProcessBidirectionalService",
    "ProcessServerPushService",
    "ProcessService",
    "ProcessServiceCallTimeout",
    "ProcessServiceClosed",
    "ProcessServiceOptionsRefused",
    "ProcessServiceError",
    "ProcessServiceFailed",
    "ProcessServiceStartError",
    "RemoteServiceError",
    "start_process_service",
]

_names = itertools.count(1)
HEARTBEAT_TIMEOUT = 10.0  # seconds of silence after which a service child is declared failed


def start_process_service(
    pipeline: str | os.PathLike[str],
    *,
    startup_timeout: float = 600.0,
    close_timeout: float = 10.0,
    kill_grace: float = 2.0,
    parent_death_signal: bool = True,
    name: str | None = None,
    environment: dict[str, str] | None = None,
    heartbeat_timeout: float | None = HEARTBEAT_TIMEOUT,
    call_deadlines: CallDeadlines | None = None,
    offered: dict[str, Any] | None = None,
    **options: Any,
) -> ProcessBidirectionalService | ProcessServerPushService:
    """Spawn a child that loads ``pipeline`` with ``load_service(pipeline, **options)``; return its proxy.

    Blocking (call it from a thread under trio): returns once the child has
    loaded the pipeline and reported its kind, or raises
    :class:`ProcessServiceStartError` (with the child's traceback) after the
    child has exited. ``options`` must pickle; ``environment`` is set in the
    child before the pipeline is imported (e.g. ``CUDA_VISIBLE_DEVICES``); ``offered`` as for
    :func:`pipelines.loader.load_service`; ``call_deadlines``: how long each call waits for the child
    (the defaults of :class:`CallDeadlines` when None).
    """
    name = name or f"process-service-{next(_names)}"
    link = ServiceLink(
        str(Path(pipeline)), dict(options), name=name, close_timeout=close_timeout, kill_grace=kill_grace,
        parent_death_signal=parent_death_signal, environment=environment, heartbeat_timeout=heartbeat_timeout,
        offered=offered,
    )
    ready = link.start(startup_timeout)
    if ready.kind not in (BidirectionalService.kind, ServerPushService.kind):
        link.close()
        raise ProcessServiceStartError(f"{name}: the child reported an unknown service kind {ready.kind!r}")
    inputs = frozenset(ready.inputs_taken)  # the child's declaration, the proxy's own
    service: ProcessBidirectionalService | ProcessServerPushService = (
        ProcessBidirectionalService(link, supports_timeline=ready.supports_timeline, inputs_taken=inputs,
                                    call_deadlines=call_deadlines)
        if ready.kind == BidirectionalService.kind
        else ProcessServerPushService(link, inputs_taken=inputs, call_deadlines=call_deadlines)
    )
    if ready.offered_taken is not None:  # the proxy stands for the child's service: what that took, it took
        record_offered_taken(service, frozenset(ready.offered_taken))
    return service

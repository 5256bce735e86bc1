"""The stream server (HTTP API, rooms, transports, runners). Imports states, engine and pipelines.

``server:app`` is the application built from ``CHUNKLINE_*`` environment
variables (``CHUNKLINE_PIPELINE`` names the pipeline), for
``hypercorn --worker-class trio server:app`` — plain ``hypercorn server:app``
works too. It is built on first access, so importing the package stays cheap.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from . import early_signals
from .console import tell

# in hypercorn's worker process, which is importing this to load ``server:app``: a stop signal from here ends its
# start in one line (a SIGHUP under its supervisor, a reload, with 0: a new worker starts); elsewhere nothing changes
early_signals.starting_hypercorn_worker()

__all__ = ["app", "build_app_from_environment"]

_app: Any = None


#: What plain ``hypercorn server:app`` serves with no ``CHUNKLINE_PIPELINE``: the embedded default
#: (the toy world on the local transport), as ``make run`` does.
DEFAULT_PIPELINE = str(Path(__file__).resolve().parent.parent / "pipelines" / "toy_world")


#: settings of where ``chunkline stream-serve`` listens: under ``hypercorn server:app`` hypercorn's ``--bind`` decides
HYPERCORN_BINDS = frozenset({"CHUNKLINE_HOST", "CHUNKLINE_PORT"})
#: settings of ``chunkline stream-serve``'s front (``server.front``), which plain hypercorn does not run
FRONT_ONLY = frozenset({"CHUNKLINE_MAX_BODY_BYTES_IN_FLIGHT", "CHUNKLINE_SOCKET_SEND_BUFFER"})


def build_app_from_environment(environ: Mapping[str, str] | None = None) -> Any:
    """The app from ``CHUNKLINE_*`` variables; raises SettingsError naming the variable at fault."""

    from . import hypercorn_drain
    from .hypercorn_connections import bound_writes, release_closed_connections
    from .hypercorn_messages import end_oversized_messages
    from .room_socket import WRITE_DEADLINE
    from .app import create_app
    from .asgi_shim import TrioASGIAnyWorker
    from .log_setup import log_under_hypercorn
    from .open_access import WarnsOnceIfOpen
    from .setting_fields import require_existing_pipeline, require_usable_gpus
    from .settings import ServerSettings

    env = dict(os.environ if environ is None else environ)
    env.setdefault("CHUNKLINE_PIPELINE", DEFAULT_PIPELINE)
    settings = ServerSettings.from_sources({}, env)
    log_under_hypercorn()  # hypercorn configures its own loggers only: chunkline's INFO lines were dropped
    for warning in ServerSettings.ignored_variables(env):  # a line each, as a bad setting's error is
        tell(f"chunkline: warning: {warning}")
    for variable in sorted(HYPERCORN_BINDS & env.keys()):  # hypercorn binds where its --bind says
        tell(f"chunkline: warning: {variable} is ignored under hypercorn, which listens where its --bind says "
             f"(chunkline stream-serve reads it)")
    for variable in sorted(FRONT_ONLY & env.keys()):  # hypercorn serves its connections itself
        tell(f"chunkline: warning: {variable} is ignored under hypercorn, which serves the connections itself "
             f"(chunkline stream-serve's front reads it)")
    # as `chunkline stream-serve` does: a missing pipeline is one line at start, not a worker's crash loop
    require_existing_pipeline(settings.pipeline, "CHUNKLINE_PIPELINE")
    require_usable_gpus(settings, "CHUNKLINE_WORKER_GPU_MAP")
    allow_service_children()
    app = TrioASGIAnyWorker(create_app(settings))
    # in a hypercorn worker: one server is one process (a second worker process was a second server on the port)
    hypercorn_drain.refuse_several_workers(_refuse_several_workers)
    # in a hypercorn worker: when hypercorn is told to stop (or its worker got a stop signal itself), the sessions
    # drain before it closes connections, and a worker still loading its pipeline then ends the process at once
    # (stream-serve's end: the load is abandoned); a second stop signal ends it at once too
    runtime = app.extensions["chunkline"]

    async def drain(status: int) -> None:
        await app.run_in_app_loop(functools.partial(hypercorn_drain.drain_then_end_a_load, runtime, status))

    hypercorn_drain.install(drain, functools.partial(hypercorn_drain.abandon, runtime), runtime.held_loop)
    release_closed_connections()  # hypercorn's trio worker: a closed connection is let go now, not at its keep-alive
    bound_writes(WRITE_DEADLINE)  # ... and a write waits at most that long (a frozen viewer held its exit for ever)
    end_oversized_messages()  # a WebSocket message past its limit is dropped and its connection ends (it was kept)
    return app if settings.api_key else WarnsOnceIfOpen(app)  # hypercorn's bind is known once it answers


def allow_service_children() -> None:
    """Let this process start service children (``--worker-mode process``) when it is hypercorn's worker.

    hypercorn's supervisor starts its worker as a daemonic multiprocessing process, and multiprocessing refuses a
    daemonic process any child ("daemonic processes are not allowed to have children"): every service child failed
    to start and the worker slot restarted until it gave up. In this process the flag does nothing else: the
    supervisor's exit hook reads its own copy of it, and this process's exit hook reads its children's flags. What
    the flag stands for, children that do not outlive their parent, chunkline does itself: a service child dies
    with the thread that spawned it (Linux's parent-death signal, SIGKILL) and watches its parent; a drain stops it
    and removes its /dev/shm segments; an abort ends it and its segments first (``engine.supervised_child``)."""
    import multiprocessing

    me = multiprocessing.current_process()
    if me.daemon and multiprocessing.parent_process() is not None:
        me.daemon = False  # public setter; it refuses only a process object that was started from this one


def _refuse_several_workers(workers: int) -> None:
    """``hypercorn --workers N`` (N > 1): one line, and the command fails as for a bad setting, before anything is
    served. Each worker process was a server of its own on the one port (its own sessions, tokens, rooms and model
    workers): a session made through one was a 404 through another, and its token was refused there."""
    _refuse_start(f"chunkline: hypercorn --workers {workers} would run {workers} separate servers on one port (each "
                  f"its own sessions, tokens and model workers); run one worker process (--workers 1, the default) "
                  f"and scale with CHUNKLINE_NUM_WORKERS or worker agents")


def _refuse_start(line: str) -> NoReturn:
    """The start fails as for a bad setting: ``line`` is said, hypercorn's supervisor and its other processes end.
    Every worker process of a ``--workers N`` start comes here, a moment apart: the first says it and ends the rest
    (each said it)."""
    if _first_to_refuse():
        tell(line)
        _end_hypercorn_supervisor()
    else:  # the first ends this one: had it ended first, the supervisor stopped the first with a SIGTERM (a line)
        import time

        time.sleep(10)
    os._exit(2)


_refusal_claim: list[Any] = []  # held until the process ends


def _first_to_refuse() -> bool:
    """Whether no other worker process of the same hypercorn start refused first: each claims one name (a Linux
    abstract socket, which goes with its process). Where there is none, each says it."""
    import socket

    claim = socket.socket(socket.AF_UNIX)
    try:
        claim.bind(f"\0chunkline-refused-workers-{os.getppid()}")
    except OSError as exc:
        claim.close()
        return exc.errno != errno.EADDRINUSE
    _refusal_claim.append(claim)
    return True


def _end_hypercorn_supervisor() -> None:
    """End hypercorn's supervising process, so that the command fails (it cannot start).

    Plain ``hypercorn server:app`` loads the app in a spawned worker; hypercorn 0.18's
    supervisor loses that worker's exit status and would exit 0. Only a parent whose
    command line is hypercorn's is ended, with SIGKILL (it takes SIGTERM as a clean
    stop), and the other processes it started first: its multiprocessing resource
    tracker, which would otherwise print warnings about the supervisor's semaphores
    after the one line, and its other worker processes, which would serve on.
    """
    import multiprocessing
    import signal

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None or b"hypercorn" not in _command_line(parent.pid):
        return
    _unlink_inherited_semaphores()  # the tracker that would have (noisily) is ended with the supervisor
    for child in _children(parent.pid):  # the tracker, and the other workers of the start (each would serve on)
        if child != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(parent.pid, signal.SIGKILL)


def _unlink_inherited_semaphores() -> None:
    """Unlink the named semaphores of the supervisor's shutdown event, which this worker holds: ended by SIGKILL
    with its resource tracker, the supervisor left them in /dev/shm (five a start with a bad setting)."""
    import contextlib
    import gc
    import warnings
    from multiprocessing.synchronize import SemLock

    try:
        from _multiprocessing import sem_unlink  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - no named semaphores on this platform
        return
    with warnings.catch_warnings():  # an isinstance of each object: torch's deprecated ones each warned (a 2nd line)
        warnings.simplefilter("ignore")
        locks = [obj for obj in gc.get_objects() if isinstance(obj, SemLock)]
    for lock in locks:
        name = getattr(lock._semlock, "name", None)  # noqa: SLF001 - the one way to a semaphore's name
        if name:
            with contextlib.suppress(OSError):
                sem_unlink(name)


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []


class _LazyApp:
    """A real module attribute (hypercorn looks ``app`` up with ``eval``) that builds the
    application on first use, so ``import server`` needs no configuration."""

    def _target(self) -> Any:
        global _app
        if _app is None:
            from .setting_values import SettingsError

            try:
                _app = build_app_from_environment()
            except SettingsError as exc:  # one line naming the variable, not a traceback from inside hypercorn
                _refuse_start(f"chunkline: {exc}")
            early_signals.hypercorn_app_built()  # in hypercorn's worker: from here a stop signal waits for its loop
        return _app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._target()(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


app = _LazyApp()

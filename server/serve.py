"""Run the stream server: the front on the public port, hypercorn behind it, a bounded drain on a stop signal.

The front (:mod:`server.front`) owns every client connection: it serves the local rooms' WebSockets
itself and splices HTTP to hypercorn on a Unix socket, each with its deadlines. SIGTERM, SIGINT or SIGHUP (its
terminal closed: the default action ended it at once, leaving its folders behind; ignored as under ``nohup``, it
stays ignored) drains live sessions (they get ``done``), sends room clients away and exits 0 within
:data:`SHUTDOWN_BOUND` seconds whatever any client does; past it a watchdog ends the process (exit 128 + the
signal: see :class:`~server.stop_guard.BoundWatch`). A second stop signal during that drain ends the process at once (exit 128 +
the first signal), and so does the first one's drain when a worker still loads its pipeline: nothing of it was
there to drain, and its load (minutes, or hung) is not waited for.

Only this server's user can reach hypercorn past the front: its socket is a file in a folder of the server's
own (mode 0700, see :mod:`server.server_folders`), not in the abstract namespace, where any local process of
any user could connect and skip every bound the front enforces. Nothing the server makes on disk outlives
it: that folder and the uploads folder go on every exit the server controls, the watchdog's and a second
signal's included, and the ones a killed server left are removed by the next server as it starts.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from typing import Any

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve

from .app import create_app
from .console import tell
from .runtime import SHUTDOWN_GRACE
from .front import MAX_CONNECTIONS, MAX_HEAD, Front
from .http_framing import BodyBudget
from .hypercorn_connections import release_closed_connections
from .log_setup import log_to_stderr
from .open_access import UNGUARDED, is_loopback
from .open_files import connection_cap, raise_open_files_limit
from .room_socket import Deadlines
from . import early_signals
from .early_signals import stop_signals
from .run_signals import exit_on_stop_signals, handlers_kept, said_to
from .server_folders import ServerFolder
from .setting_values import ListenError
from .settings import ServerSettings
from .stop_guard import StopGuard
from .transport.local import LocalRooms
from .transport.local_room import largest_sent

__all__ = ["FRONT_GRACE", "SHUTDOWN_BOUND", "ListenError", "run", "serve_app"]

log = logging.getLogger("chunkline.serve")

FRONT_GRACE = 5.0  # seconds open HTTP connections get to finish once the sessions are drained
KEEP_ALIVE_MARGIN = 5.0  # seconds hypercorn keeps an idle connection past the longest the front may
#: seconds from the signal to the exit: the drain (two grace periods), the connections' grace, a margin
SHUTDOWN_BOUND = 2 * SHUTDOWN_GRACE + FRONT_GRACE + 10.0
BACKEND_SOCKET = "http.sock"  # hypercorn's socket, in the server's "front" folder


class _HandedSocket(Config):
    """hypercorn's config with the listening socket made here (hypercorn binds only paths, ports and fds)."""

    def __init__(self, listener: socket.socket) -> None:
        super().__init__()
        self._listener = listener

    def create_sockets(self) -> Sockets:
        return Sockets(secure_sockets=[], insecure_sockets=[self._listener], quic_sockets=[])


def _backend_socket(folder: ServerFolder) -> socket.socket:
    """hypercorn's socket, a file in the server's private ``folder``: only this user may connect to it."""
    path = os.path.join(folder.make(), BACKEND_SOCKET)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
    except OSError as exc:  # e.g. a temporary directory whose path is too long for a Unix socket's
        listener.close()
        why = exc.strerror or exc
        raise ListenError("TMPDIR", f"TMPDIR: cannot make the front's Unix socket {path}: {why}") from None
    except BaseException:
        listener.close()
        raise
    return listener


async def serve_app(
    settings: ServerSettings,
    *,
    deadlines: Deadlines | None = None,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP; live sessions drain (bounded) before the process exits.

    ``deadlines`` bounds what each client connection may take (the defaults of :class:`Deadlines`);
    setting ``stop`` shuts the server down as a signal would."""
    try:
        listeners = await trio.open_tcp_listeners(settings.port, host=settings.host)
    except OSError as exc:
        raise ListenError.of("--host/--port", settings.host, settings.port, exc) from None
    if settings.port == 0:
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]  # one free port, not one per address family
    backend: socket.socket | None = None
    folder = ServerFolder("front")
    try:
        if settings.workers != "in-process":
            await _check_cluster_address(settings)
        app = create_app(settings)
        backend = _backend_socket(folder)
        await _serve(app, settings, backend, folder, listeners, deadlines, stop, task_status)
    finally:
        if backend is not None:
            backend.close()  # hypercorn closes it too once it served on it
        folder.remove()
        for listener in listeners:
            await listener.aclose()  # each closed by serving on it too; this covers a failed start


async def _serve(
    app: Any,
    settings: ServerSettings,
    backend: socket.socket,
    folder: ServerFolder,
    listeners: list[trio.SocketListener],
    deadlines: Deadlines | None,
    stop: trio.Event | None,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    runtime = app.extensions["chunkline"]

    def remove() -> None:
        """Take what the server holds on disk: its uploads, hypercorn's socket."""
        runtime.uploads.remove()
        folder.remove()

    def abandon() -> None:
        """Before the process ends at once: what it holds on disk, and its service processes with what their
        channels hold in /dev/shm (their parent-death signal would end them and leave that behind)."""
        remove()
        runtime.end_service_processes_now()

    config = _HandedSocket(backend)
    config.accesslog = None
    # hypercorn's own lines go through the server's logging (one format, each line once: its own handler wrote them
    # a second time), warnings and errors only: its "Running on" names the socket behind the front, and the server's
    # "serving ... on" line says where clients connect
    hypercorn_log = logging.getLogger("hypercorn.error")
    hypercorn_log.setLevel(logging.WARNING)
    config.errorlog = hypercorn_log
    config.graceful_timeout = FRONT_GRACE  # sessions are drained before hypercorn is told to stop
    # the front keeps a client's connection open while it is idle (Deadlines.idle), passes a head on once it is whole
    # (Deadlines.head of its first byte) and bounds a body's pace: hypercorn, hearing nothing meanwhile, must not
    # close the connection first (its 5 s keep-alive closed one whose next head was begun in time and finished after,
    # unanswered), whether waiting for a head (keep_alive_timeout) or in a read (read_timeout)
    front_deadlines = deadlines or Deadlines()
    config.keep_alive_timeout = config.read_timeout = front_deadlines.idle + front_deadlines.head + KEEP_ALIVE_MARGIN
    # ... and a connection the front has closed is let go at once, not that long after (a descriptor each)
    release_closed_connections()
    # the front writes each head again with "\r\n" endings and ": " after each name, so one within MAX_HEAD
    # may reach hypercorn up to 5/3 as long (a bare "a:\n" line becomes "a: \r\n"): h11 must take that whole
    config.h11_max_incomplete_size = 2 * MAX_HEAD
    config.websocket_max_message_size = largest_sent(settings.max_data_message_bytes) + 1024
    rooms = runtime.transport if isinstance(runtime.transport, LocalRooms) else None
    budget = BodyBudget(settings.max_body_bytes_in_flight, max_body=settings.max_body_bytes)
    open_files = raise_open_files_limit(MAX_CONNECTIONS)
    cap = connection_cap(MAX_CONNECTIONS, open_files)
    config.backlog = cap  # hypercorn's listen queue holds a connect from each connection the front serves at once
    front = Front(
        rooms, backend.getsockname(), max_message_bytes=largest_sent(settings.max_data_message_bytes),
        deadlines=front_deadlines,
        body_budget=budget, send_buffer=settings.socket_send_buffer, max_connections=cap,
    )
    stop = trio.Event() if stop is None else stop  # a signal arrived (or the caller asked)
    hypercorn_stop = trio.Event()  # sessions drained: hypercorn may stop

    def cut_short() -> str:
        """What a second stop signal cuts short, as its line says (once the drain's last line said it was over, not
        the drain)."""
        return "the connections' grace, after the drain" if runtime.drained else "the drain"

    # the first signal starts the bound and looks at the loop, a second ends the process: with no loop (stop_guard)
    guard = StopGuard(SHUTDOWN_BOUND, abandon, cut_short, runtime.held_loop, log)
    signalled = guard.signalled  # the first stop signal, once one came: an abort exits 128 + it

    async def on_signals() -> None:
        """The first signal starts the drain (a second one, heard by the guard, ends it now), and one that comes after
        the drain while the process is still on its way out ends it too (the signal's own default action ended it
        there, leaving the stages' shared memory and the front's folder behind)."""
        try:
            with trio.open_signal_receiver(*stop_signals()) as signals:
                guard.wrap(stop_signals())
                # a pipeline that puts handlers of its own there (in its running()) made the server deaf to them
                with handlers_kept({number: signal.getsignal(number) for number in stop_signals()}, said_to(log)):
                    early_signals.replay()  # one that came as the trio run started (the command deferred it)
                    async for _number in signals:
                        stop.set()
        finally:
            if signalled:
                exit_on_stop_signals(128 + signalled[0], "during the shutdown", abandon, log)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signals)
            await nursery.start(
                lambda task_status: serve(app, config, shutdown_trigger=hypercorn_stop.wait, task_status=task_status)
            )
            accepting = trio.CancelScope()
            nursery.start_soon(_accept, listeners, front, accepting, nursery)
            urls = [_url(listener) for listener in listeners]
            runtime.serving_at(urls[0])  # agents join the local rooms at this address
            task_status.started(urls)
            for url in urls:  # a stderr on a full disk, or closed, is no reason not to serve (tell)
                tell(f"chunkline: serving {settings.pipeline} on {url} (transport: {settings.transport})")
            if not settings.api_key and any(not is_loopback(listener.socket.getsockname()[0]) for listener in listeners):
                tell(f"chunkline: warning: no --api-key, and the server listens beyond this host: {UNGUARDED}")
            if cap < MAX_CONNECTIONS:
                tell(f"chunkline: warning: the open-file limit ({open_files}, ulimit -n) lets the server serve "
                     f"{cap} connections at once, not {MAX_CONNECTIONS}: raise it to serve more")
            await stop.wait()
            guard.bound.arm()  # from the signal, if one began the stop (armed already then), else from now
            nursery.cancel_scope.deadline = trio.current_time() + guard.bound.seconds_left() - 5.0
            # drain first: live sessions say "done" to their rooms, then the room clients are sent away
            await runtime.drain_for_stop()
            # no new connection once hypercorn stops: each was accepted and then dropped unanswered (refused now)
            accepting.cancel()
            front.stopping = True  # before a client can see the listener closed: requests from now on are told so
            for listener in listeners:
                await listener.aclose()
            hypercorn_stop.set()
            with trio.move_on_after(FRONT_GRACE):
                while front.connections:
                    await trio.sleep(0.05)
            front.close()
            if signalled:  # a load left to wait for is abandoned (it held the exit until the watchdog): 128 + the
                # signal, even after a drain of other workers' sessions (a load was cut)
                runtime.in_process.abandon_a_load(signalled[0], abandon, log)
            nursery.cancel_scope.cancel()
    finally:
        guard.bound.cancel()
        remove()


async def _check_cluster_address(settings: ServerSettings) -> None:
    """Bind the agents' port once and let it go, so an address in use is a clear error here, not a traceback
    from the app's startup (the authority binds it again a moment later)."""
    host = settings.cluster_host or settings.host
    try:
        for listener in await trio.open_tcp_listeners(settings.cluster_port, host=host):
            await listener.aclose()
    except OSError as exc:
        raise ListenError.of("--cluster-host/--cluster-port", host, settings.cluster_port, exc) from None


async def _accept(
    listeners: list[trio.SocketListener], front: Front, accepting: trio.CancelScope, connections: trio.Nursery
) -> None:
    """Accept connections until ``accepting`` is cancelled; each is served in ``connections``, so those open
    then go on (the front ends them once their grace is over)."""
    with accepting:
        await trio.serve_listeners(front.handle, listeners, handler_nursery=connections)


def _url(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(settings: ServerSettings) -> int:
    log_to_stderr()
    trio.run(serve_app, settings)
    return 0

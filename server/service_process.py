"""The child process behind a ProcessService: spawn, watch, read, stop (the parent's side).

One *monitor* thread per service spawns the child (Linux's parent-death signal
fires when the spawning thread ends, so it must outlive the child), reads the
pipe, waits on the child's sentinel, escalates a stop (graceful, terminate,
kill) and reaps it. Messages reach the trio run that attached to it through
its trio token. See :mod:`server.process_service` for the proxy built on it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_ready
from typing import Any

import trio

from pipelines.contract import ControlRejected

from .process_service_child import child_main, dumps, loads

__all__ = [
    "ProcessServiceClosed",
    "ProcessServiceError",
    "ProcessServiceFailed",
    "ProcessServiceStartError",
    "RemoteServiceError",
    "ServiceProcess",
]

log = logging.getLogger("chunkline.process_service")

MONITOR_POLL = 0.1  # seconds between the monitor's checks of stop deadlines
PIPE_CLOSED_GRACE = 1.0  # seconds a child that closed its pipe gets to exit before it is killed



class ProcessServiceError(RuntimeError):
    """Base of the process service's errors."""


class ProcessServiceStartError(ProcessServiceError):
    """The child could not load the pipeline (with its traceback), exited, or was not ready in time."""


class ProcessServiceFailed(ProcessServiceError):
    """The child died or its pipe closed unexpectedly: every pending and later call fails with this."""


class ProcessServiceClosed(ProcessServiceError):
    """The service is not running (before ``running()``, or after it was left)."""


class RemoteServiceError(ProcessServiceError):
    """The service raised in the child; ``remote_traceback`` is the child's traceback text."""

    def __init__(self, message: str, *, method: str, remote_type: str, remote_message: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback


def _remote_error(method: str, payload: tuple[str, str, str, str | None]) -> Exception:
    kind, message, tb, reason = payload
    if reason is not None:
        return ControlRejected(reason)
    return RemoteServiceError(
        f"{method}() raised {kind}: {message}\n--- child traceback ---\n{tb}",
        method=method, remote_type=kind, remote_message=message, remote_traceback=tb,
    )


# -- the child process (thread side) ---------------------------------------------------------


class ServiceProcess:
    """Spawns, watches and reaps one service process; thread-safe; knows nothing of trio state."""

    def __init__(
        self,
        pipeline: str,
        options: dict[str, Any],
        *,
        name: str,
        close_timeout: float,
        kill_grace: float,
        parent_death_signal: bool,
    ) -> None:
        self.pipeline = pipeline
        self.options = options
        self.name = name
        self.close_timeout = close_timeout
        self.kill_grace = kill_grace
        self.parent_death_signal = parent_death_signal
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._conn_closed = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._handler: Callable[[tuple], None] | None = None
        self._early: list[tuple] = []
        self._detached = False
        self._startup: tuple | None = None
        self._ready = threading.Event()
        self._exited = threading.Event()
        self._stop_at: float | None = None
        self._kill_now = False
        self._monitor = threading.Thread(target=self._run, name=f"{name}-monitor", daemon=True)

    # -- start ---------------------------------------------------------------------------

    def start(self, timeout: float) -> tuple[str, bool]:
        """Spawn the child and wait until it reports its kind; raises ProcessServiceStartError."""
        self._monitor.start()
        if not self._ready.wait(timeout):
            self.kill()
            self.wait_closed()
            raise ProcessServiceStartError(f"{self.name}: loading {self.pipeline!r} did not finish within {timeout:g}s")
        outcome = self._startup
        assert outcome is not None
        if outcome[0] == "ready":
            return str(outcome[1]), bool(outcome[2])
        self.close()
        if outcome[0] == "startup_failed":
            raise ProcessServiceStartError(
                f"{self.name}: loading {self.pipeline!r} in the child process failed:\n--- child traceback ---\n{outcome[1]}"
            )
        if outcome[0] == "spawn_failed":
            raise ProcessServiceStartError(f"{self.name}: could not start the child process: {outcome[1]}")
        raise ProcessServiceStartError(
            f"{self.name}: the child process (pid {self.pid}) exited during startup with code {self.exitcode}"
        )

    # -- the monitor thread ------------------------------------------------------------------

    def _run(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        config = {
            "pipeline": self.pipeline,
            "options": self.options,
            "parent_pid": os.getpid(),
            "parent_death_signal": self.parent_death_signal,
        }
        parent_conn = child_conn = None
        try:
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            # not daemonic: the service may start worker processes of its own (process
            # placement); its lifetime is still bound to ours (parent-death signal, watchdog,
            # and the bounded stop in close())
            proc = ctx.Process(target=child_main, args=(child_conn, config), name=self.name, daemon=False)
            proc.start()
        except BaseException as exc:
            for conn in (parent_conn, child_conn):
                if conn is not None:
                    conn.close()
            self._startup = ("spawn_failed", repr(exc))
            self._ready.set()
            self._exited.set()
            return
        child_conn.close()
        self._proc, self._conn, self.pid = proc, parent_conn, proc.pid
        try:
            self._watch(proc, parent_conn)
        finally:
            proc.join()  # its sentinel fired (or it was killed): this does not block long
            with self._send_lock:
                self._conn_closed = True
                parent_conn.close()
            self.exitcode = proc.exitcode
            proc.close()
            if not self._ready.is_set():
                self._startup = ("exited", self.exitcode)
                self._ready.set()
            self._deliver(("exit", self.exitcode))
            self._exited.set()

    def _watch(self, proc: Any, conn: Any) -> None:
        conn_open = True
        pipe_closed_at: float | None = None
        terminated = killed = False
        while True:
            waitables = [proc.sentinel, conn] if conn_open else [proc.sentinel]
            ready = wait_ready(waitables, MONITOR_POLL)
            if conn_open and conn in ready:
                conn_open = self._read(conn)
            if proc.sentinel in ready:
                while conn_open and conn.poll():  # messages sent just before it exited
                    conn_open = self._read(conn)
                return
            now = time.monotonic()
            if not conn_open and pipe_closed_at is None:
                pipe_closed_at = now
            with self._lock:
                stop_at, kill_now = self._stop_at, self._kill_now
            if kill_now and not killed:
                proc.kill()
                killed = True
            elif pipe_closed_at is not None and stop_at is None and now - pipe_closed_at > PIPE_CLOSED_GRACE and not killed:
                proc.kill()  # it closed its pipe but lives on: it can serve nobody
                killed = True
            elif stop_at is not None:
                if now - stop_at > self.close_timeout and not terminated:
                    proc.terminate()
                    terminated = True
                if now - stop_at > self.close_timeout + self.kill_grace and not killed:
                    proc.kill()
                    killed = True

    def _read(self, conn: Any) -> bool:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return False  # the child is exiting; its sentinel says how
        try:
            message = loads(data)
        except Exception as exc:
            message = ("protocol_error", f"a message from the child could not be read: {exc!r}")
        if not self._ready.is_set() and message[0] in ("ready", "startup_failed"):
            self._startup = message
            self._ready.set()
            return True
        self._deliver(message)
        return True

    def _deliver(self, message: tuple) -> None:
        with self._lock:
            if self._detached:
                return
            token, handler = self._token, self._handler
            if token is None or handler is None:
                self._early.append(message)
                return
        try:
            token.run_sync_soon(handler, message)
        except trio.RunFinishedError:
            pass

    # -- used from the trio thread (or any thread) ----------------------------------------------

    def attach(self, token: trio.lowlevel.TrioToken, handler: Callable[[tuple], None]) -> list[tuple]:
        """Deliver messages to ``handler`` on the trio run of ``token``; returns those that came before."""
        with self._lock:
            self._token, self._handler = token, handler
            early, self._early = self._early, []
        return early

    def detach(self) -> None:
        with self._lock:
            self._detached = True
            self._token = self._handler = None
            self._early = []

    def send(self, message: tuple) -> bool:
        """Send a message; False when the child is gone (the monitor reports how)."""
        data = dumps(message)
        with self._send_lock:
            if self._conn_closed or self._conn is None:
                return False
            try:
                self._conn.send_bytes(data)
            except OSError:
                return False
        return True

    def request_stop(self) -> None:
        """Ask the child to stop (non-blocking); it is terminated, then killed, if it does not."""
        with self._lock:
            if self._stop_at is not None:
                return
            self._stop_at = time.monotonic()
        self.send(("stop",))

    def kill(self) -> None:
        with self._lock:
            self._kill_now = True
            if self._stop_at is None:
                self._stop_at = time.monotonic()

    def wait_closed(self) -> None:
        """Wait until the child is reaped and the pipe closed (bounded once a stop was requested)."""
        bound = self.close_timeout + 3 * self.kill_grace + 5.0
        if not self._exited.wait(bound):  # pragma: no cover - kill did not take
            log.error("%s: child pid %s still not reaped after %gs", self.name, self.pid, bound)
        self._monitor.join(bound)

    def close(self) -> None:
        """Stop the child and wait for it (bounded); idempotent; blocking."""
        if self._monitor.ident is None:
            return
        self.request_stop()
        self.wait_closed()


# -- the proxies (trio side) -------------------------------------------------------------------------



"""The one child behind a process service's proxy: its supervisor, and delivery into trio.

:class:`ServiceLink` owns an :class:`engine.supervisor.Supervisor` with a single
child running :func:`server.process_service.child.child_main`. It turns the
child's hello into a :class:`~server.process_service.wire.Ready` (or a
:class:`ProcessServiceStartError` with the child's traceback), decodes every
later message, and hands it to the trio run that attached to it (through its
trio token), in order; messages that come before anyone attached are kept and
handed over on attach. Thread-safe; it holds no trio state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import trio

from engine.shm_names import remove_segments_of
from engine.supervisor import ChildExit, ChildSpec, StartupFailed, StartupProblem, Supervisor

from . import wire
from .child import child_main
from .errors import ProcessServiceOptionsRefused, ProcessServiceStartError, last_line

__all__ = ["ServiceLink"]


class _LoadFailed(Exception):
    """The child's hello said that loading the pipeline failed."""

    def __init__(self, traceback_text: str, options_refused: bool) -> None:
        super().__init__("loading the pipeline failed")
        self.traceback_text = traceback_text
        self.options_refused = options_refused


class ServiceLink:
    """Spawns, watches and stops one service child; delivers its messages to a trio run."""

    def __init__(
        self, pipeline: str, options: dict[str, Any], *, name: str, close_timeout: float, kill_grace: float,
        parent_death_signal: bool, environment: dict[str, str] | None = None, heartbeat_timeout: float | None = None,
        offered: dict[str, Any] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.name = name
        self.ready: wire.Ready | None = None
        self.exitcode: int | None = None
        # not daemonic: the service may start worker processes of its own (process placement);
        # its lifetime is still bound to ours (parent-death signal, watchdog, and the bounded stop)
        config = {"pipeline": pipeline, "options": options, "environment": environment or {}, "offered": offered or {}}
        spec = ChildSpec(name, child_main, config, daemon=False)
        self._supervisor = Supervisor(
            [spec], on_message=self._on_bytes, on_exit=self._on_exit, close_timeout=close_timeout,
            kill_grace=kill_grace, parent_death_signal=parent_death_signal, name=name,
            heartbeat_timeout=heartbeat_timeout,
        )
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._handler: Callable[[Any], None] | None = None
        self._early: list[Any] = []
        self._detached = False

    @property
    def pid(self) -> int | None:
        return self._supervisor.pids[0]

    # -- start ---------------------------------------------------------------------------

    def start(self, timeout: float) -> wire.Ready:
        """Spawn the child and wait for its hello; raises ProcessServiceStartError (the child reaped)."""
        try:
            self._supervisor.start(timeout, check_hello=self._check_hello)
        except StartupFailed as failure:
            raise self._start_error(failure, timeout) from None
        assert self.ready is not None
        return self.ready

    def _check_hello(self, index: int, data: bytes) -> None:
        message = wire.loads(data)
        if isinstance(message, wire.LoadFailed):
            raise _LoadFailed(message.traceback, message.options_refused)
        if not isinstance(message, wire.Ready):
            raise TypeError(f"the child's first message was {type(message).__name__}, not Ready")
        self.ready = message

    def _start_error(self, failure: StartupFailed, timeout: float) -> ProcessServiceStartError:
        cause = failure.__cause__
        if isinstance(cause, _LoadFailed):
            error = ProcessServiceOptionsRefused if cause.options_refused else ProcessServiceStartError
            last = last_line(cause.traceback_text, "(no traceback)")
            return error(  # the cause in the first line: health and the log's summary show that line alone
                f"{self.name}: loading {self.pipeline!r} in the child process failed: {last}\n"
                f"--- child traceback ---\n{cause.traceback_text}",
                child_error=last,
            )
        if failure.problem == StartupProblem.TIMED_OUT:
            return ProcessServiceStartError(f"{self.name}: loading {self.pipeline!r} did not finish within {timeout:g}s")
        if failure.problem == StartupProblem.EXITED:
            return ProcessServiceStartError(
                f"{self.name}: the child process (pid {failure.pid}) exited during startup with code {failure.exitcode}",
                child_error=f"the child process exited during startup with code {failure.exitcode}",
            )
        if failure.problem == StartupProblem.SPAWN_FAILED:
            return ProcessServiceStartError(f"{self.name}: could not start the child process: {cause!r}")
        return ProcessServiceStartError(f"{self.name}: the child process refused to start: {cause}")

    # -- messages (the supervisor's monitor thread) ------------------------------------------------

    def _on_bytes(self, index: int, data: bytes) -> None:
        try:
            message = wire.open_sealed(wire.loads(data))  # the pipeline's value too, here and not on the trio thread
        except Exception as exc:
            message = wire.ProtocolError(f"a message from the child could not be read: {exc!r}")
        self._deliver(message)

    def _on_exit(self, exit: ChildExit) -> None:
        # reaped: what a killed child's channels held in /dev/shm goes now, before anyone may see it gone (an abort
        # that finds the child reaped takes nothing: the trio thread may never run ChildExited's handler)
        if exit.pid is not None:
            remove_segments_of(exit.pid)
        self.exitcode = exit.exitcode
        self._deliver(wire.ChildExited(exit.exitcode, exit.expected, exit.cause))

    def _deliver(self, message: Any) -> None:
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

    def attach(self, token: trio.lowlevel.TrioToken, handler: Callable[[Any], None]) -> list[Any]:
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

    def send(self, message: Any) -> bool:
        """Send one wire message (pickled here: a pickling error is the caller's); False when the child is gone."""
        return self._supervisor.send(0, wire.dumps(message))

    def request_stop(self) -> None:
        """Ask the child to stop (non-blocking); it is terminated, then killed, if it does not."""
        self._supervisor.stop(wire.dumps(wire.Stop()))

    def kill(self, cause: str) -> None:
        self._supervisor.kill(0, cause=cause)

    def wait_closed(self) -> None:
        """Wait until the child is reaped and its pipe closed (bounded once a stop was requested)."""
        self._supervisor.wait_closed()

    def close(self) -> None:
        """Stop the child and wait for it (bounded; idempotent; blocking)."""
        self._supervisor.close(wire.dumps(wire.Stop()))

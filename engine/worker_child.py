"""The child side of :class:`engine.workers.ProcessWorkerGroup`: one rank's process.

The parent spawns :func:`child_main` with its end of a pipe and a plain config
dict. The child first arranges to die with its parent (Linux parent-death
signal, plus a watchdog thread that notices ``os.getppid()`` changing), then
builds its rank object with ``factory(rank=..., world_size=..., device=...)``
and serves calls until it is told to shut down or its pipe closes.

Messages are tuples. Parent to child: ``("call", call_id, method, args, kwargs)``
and ``("shutdown",)``. Child to parent: ``("ready", rank, pid)``,
``("startup_failed", rank, traceback_text)``,
``("result", call_id, rank, ok, value_or_(type, message, traceback_text))``
and ``("closed", rank, traceback_text_or_None)``.

Nothing heavy is imported here: a rank imports what it needs (torch, say) in
its own factory.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["child_main", "resolve_factory"]

PR_SET_PDEATHSIG = 1
WATCHDOG_INTERVAL = 0.2  # seconds between parent checks in the child
PARENT_GONE_EXIT_CODE = 70


def resolve_factory(factory: str | Callable[..., Any]) -> Callable[..., Any]:
    """``"package.module:callable"`` (dots allowed after the colon) or a callable as is."""
    if callable(factory):
        return factory
    module_name, sep, attr_path = str(factory).partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"factory must be 'module:callable', got {factory!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"factory {factory!r} is not callable")
    return target


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when the thread that spawned it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl; the watchdog still runs
        pass


def _watch_parent(parent_pid: int) -> None:
    stop = threading.Event()  # never set: the wait is just the poll interval
    while os.getppid() == parent_pid:
        stop.wait(WATCHDOG_INTERVAL)
    os._exit(PARENT_GONE_EXIT_CODE)


def _error_payload(exc: BaseException) -> tuple[str, str, str]:
    kind = type(exc)
    return (f"{kind.__module__}.{kind.__qualname__}", str(exc), traceback.format_exc())


def child_main(conn: Any, config: dict[str, Any]) -> None:
    """Entry point of one rank process (the target of a spawn-context Process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    parent_pid = config["parent_pid"]
    if config.get("parent_death_signal", True):
        _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(PARENT_GONE_EXIT_CODE)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()

    rank = config["rank"]
    try:
        factory = resolve_factory(config["factory"])
        worker = factory(rank=rank, world_size=config["world_size"], device=config["device"])
    except BaseException:
        conn.send(("startup_failed", rank, traceback.format_exc()))
        conn.close()
        raise SystemExit(1) from None
    conn.send(("ready", rank, os.getpid()))
    try:
        _serve(conn, worker, rank)
    finally:
        conn.close()


def _serve(conn: Any, worker: Any, rank: int) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent closed its end: nothing more to do
            return
        if message[0] == "shutdown":
            error = None
            closer = getattr(worker, "close", None)
            if closer is not None:
                try:
                    closer()
                except BaseException:
                    error = traceback.format_exc()
            _send(conn, ("closed", rank, error))
            return
        _, call_id, method, args, kwargs = message
        try:
            reply = ("result", call_id, rank, True, getattr(worker, method)(*args, **kwargs))
        except BaseException as exc:
            reply = ("result", call_id, rank, False, _error_payload(exc))
        try:
            conn.send(reply)  # pickled before anything is written: a failure leaves the pipe intact
        except (EOFError, OSError):
            return
        except BaseException as exc:
            _send(conn, ("result", call_id, rank, False, _error_payload(exc)))


def _send(conn: Any, message: tuple) -> None:
    try:
        conn.send(message)
    except (EOFError, OSError):
        pass

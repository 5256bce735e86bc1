"""The child side of :class:`engine.workers.ProcessWorkerGroup`: one rank's process.

The group's :class:`engine.supervisor.Supervisor` spawns :func:`child_main` with
its end of a pipe and a plain config dict. The child first arranges to die with
its parent (:func:`engine.supervised_child.bind_to_parent`), then
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
import traceback
from collections.abc import Callable
from typing import Any

from .supervised_child import bind_to_parent

__all__ = ["child_main", "resolve_factory"]


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


def _error_payload(exc: BaseException) -> tuple[str, str, str]:
    kind = type(exc)
    return (f"{kind.__module__}.{kind.__qualname__}", str(exc), traceback.format_exc())


def child_main(conn: Any, config: dict[str, Any]) -> None:
    """Entry point of one rank process (the target of a spawn-context Process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    bind_to_parent(config)

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

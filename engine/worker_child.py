"""The child side of :class:`engine.workers.ProcessWorkerGroup`: one rank's process.

The group's :class:`engine.supervisor.Supervisor` spawns :func:`child_main` with
its end of a pipe and a plain config dict. The child first arranges to die with
its parent (:func:`engine.supervised_child.bind_to_parent`), then
builds its rank object with ``factory(rank=..., world_size=..., device=...)``
and serves calls until it is told to shut down or its pipe closes.

The messages are the attrs classes of :mod:`engine.worker_wire`: it takes
:class:`~engine.worker_wire.Call` and :class:`~engine.worker_wire.Shutdown` and
answers :class:`~engine.worker_wire.RankReady` (or
:class:`~engine.worker_wire.RankStartFailed`), then a
:class:`~engine.worker_wire.Result` or :class:`~engine.worker_wire.Raised` per
call, and :class:`~engine.worker_wire.Closed`. Any other message is an
:class:`~engine.worker_wire.UnknownWorkerMessage`: the rank exits with it, and
the group fails on that exit.

Nothing heavy is imported here: a rank imports what it needs (torch, say) in
its own factory.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable
from typing import Any

from .supervised_child import bind_to_parent, ignore_group_stop_signals
from .tensor_channel_refs import discard_sent, transfers_sent
from .timer_slack import STAGE_TIMER_SLACK_NS, set_thread_timer_slack
from .worker_wire import (
    Call, Closed, Fetched, Raised, RankReady, RankStartFailed, Result, Shutdown, UnknownWorkerMessage, dump_value, load_value,
    release_shared,
    remote_error,
)

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


def child_main(conn: Any, config: dict[str, Any]) -> None:
    """Entry point of one rank process (the target of a spawn-context Process)."""
    ignore_group_stop_signals()  # the parent decides when ranks stop: not a signal to the whole process group
    bind_to_parent(config)
    set_thread_timer_slack(STAGE_TIMER_SLACK_NS)  # a rank runs model code on this thread, as a stage thread does

    rank = config["rank"]
    try:
        factory = resolve_factory(config["factory"])
        worker = factory(rank=rank, world_size=config["world_size"], device=config["device"])
    except BaseException:
        conn.send(RankStartFailed(rank, traceback.format_exc()))
        conn.close()
        raise SystemExit(1) from None
    conn.send(RankReady(rank, os.getpid()))
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
        match message:
            case Shutdown():
                _send(conn, Closed(rank, _close(worker)))
                return
            case Call(call_id=call_id, method=method, arguments=arguments, shared=shared):
                with transfers_sent() as sent:
                    try:
                        # the arguments are pickled apart from the message: ones that do not load here fail this call
                        args, kwargs = _load_arguments(arguments, shared)
                        if shared:  # the parent holds these handles until it hears that this rank has them
                            conn.send(Fetched(call_id, rank))
                        # so is the value: one the parent cannot load fails only this call there; nothing here keeps
                        # the value once it is pickled (its shared memory is the parent's to fetch)
                        reply: Result | Raised = Result(
                            call_id, rank, *dump_value(getattr(worker, method)(*args, **kwargs)))
                    except BaseException as exc:
                        discard_sent(sent)  # what the call sent on a tensor channel: its refs never leave this rank
                        reply = Raised(call_id, rank, remote_error(exc))
                try:
                    conn.send(reply)  # pickled before anything is written: a failure leaves the pipe intact
                except (EOFError, OSError):
                    return
                except BaseException as exc:
                    _send(conn, Raised(call_id, rank, remote_error(exc)))
            case _:
                raise UnknownWorkerMessage(message, sender="the worker group", expected=(Call, Shutdown))


def _load_arguments(arguments: bytes, shared: bytes) -> Any:
    """A call's ``(args, kwargs)``; when they do not load, the shared-memory handles loading did not fetch are
    fetched and closed here, so that the parent, which holds each until a rank fetches it, holds none for good."""
    fetched: set[int] = set()
    try:
        return load_value(arguments, fetched)
    except BaseException:
        release_shared(shared, fetched)
        raise


def _close(worker: Any) -> str | None:
    """Run the rank object's ``close()``; its traceback text when it raised."""
    closer = getattr(worker, "close", None)
    if closer is None:
        return None
    try:
        closer()
    except BaseException:
        return traceback.format_exc()
    return None


def _send(conn: Any, message: Closed | Raised) -> None:
    try:
        conn.send(message)
    except (EOFError, OSError):
        pass

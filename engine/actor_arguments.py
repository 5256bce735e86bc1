"""What a :class:`~engine.actors.LocalStageActor` is given, checked as it is made, and the kinds of callable it runs.

A handler or hook the actor cannot run is refused at construction with a ``ValueError`` naming it, not as a
``TypeError`` failing the first session that calls it (or poisoning its close).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["cancel_on", "check_actor_arguments", "check_hook_returned", "is_async"]


def check_actor_arguments(handler: object, *, name: object, mailbox_capacity: object, session_closer: object) -> None:
    """Raise ``ValueError`` naming the first argument a stage actor cannot take."""
    if isinstance(mailbox_capacity, bool) or not isinstance(mailbox_capacity, int) or mailbox_capacity < 1:
        raise ValueError(f"mailbox_capacity must be an int >= 1, got {mailbox_capacity!r}")
    if not callable(handler):
        raise ValueError(f"handler must be callable, got {type(handler).__name__}")
    if session_closer is not None and not callable(session_closer):
        raise ValueError(f"session_closer must be callable or None, got {type(session_closer).__name__}")
    for role, fn in (("handler", handler), ("session_closer", session_closer)):
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):  # it read "returned generator"
            raise ValueError(f"{role} must return (a handler: its {{artifact: value}} mapping), not yield: "
                             f"{getattr(fn, '__qualname__', fn)!r} is a generator function")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be a string or None, got {type(name).__name__}")


def is_async(fn: Callable[..., Any]) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one (it was run on a thread, and its coroutine
    taken for the call's result: "returned coroutine", never awaited)."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))


async def cancel_on(event: trio.Event, scope: trio.CancelScope, reason: str) -> None:
    """Cancel ``scope`` with ``reason`` once ``event`` is set."""
    await event.wait()
    scope.cancel(reason=reason)


def check_hook_returned(actor: str, returned: object) -> None:
    """A synchronous session hook returns nothing to await: one that returned a coroutine (``lambda ctx, reason:
    release(ctx)``, ``release`` being ``async``) released nothing, and its release was said to be ``ok``."""
    if inspect.isawaitable(returned):
        if inspect.iscoroutine(returned):
            returned.close()  # it never runs: no "never awaited" warning besides this error
        raise TypeError(f"stage actor {actor!r}: its session_closer returned {type(returned).__name__}, which nothing "
                        f"awaits, so its release never ran; declare the hook itself 'async def'")

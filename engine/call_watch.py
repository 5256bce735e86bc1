"""A stage actor's call deadline: which call runs, and the task that fails the actor when one runs too long.

A stage call cannot be interrupted (model code in a thread, or an ``async`` call that must not stop mid-chunk), so
a call that never returns (a deadlocked library, a hung device) held every session of its actor, and the model
worker around it, until the sessions' own timeouts. With a ``call_timeout`` the actor is failed instead once a call
has run that long: its sessions fail at once naming the call, and its owner can replace it. The actor's close does
not wait for that call: a synchronous one keeps its (daemon) thread until it returns, if it ever does; an ``async``
one is cancelled.

A session hook (``session_closer``) runs where the calls run, behind and ahead of them: it is watched the same
way (a hook that never returned held every session of its actor, its calls queued behind it, with no error).

The call is noted by whoever runs it (the actor's one thread, or its task) as one tuple assignment, so the watching
task in trio reads a consistent picture without a lock; it looks every ``call_timeout / 8`` (at most each second) and
fails the actor once it has seen the same call running for the whole deadline: never early, at most one look late.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import trio

from .errors import StageCallTimeout

if TYPE_CHECKING:
    from .actor_protocol import SessionContext, StageInvocation

__all__ = ["CallWatch", "timed"]

#: the longest pause between two looks at the running call
LOOK_PERIOD_MAX = 1.0


class CallWatch:
    """The running call of one actor (``running``: its number, invocation or hooked session and the runner's token, or
    None) and its deadline."""

    __slots__ = ("call_timeout", "running", "_calls")

    def __init__(self, call_timeout: float) -> None:
        self.call_timeout = call_timeout
        self.running: tuple[int, StageInvocation | SessionContext, Any] | None = None
        self._calls = 0  # calls started: tells a new call from one still running (only the running side counts)

    def started(self, call: StageInvocation | SessionContext, token: Any = None) -> None:
        """On the side that runs calls, as one (an invocation, or a session's hook) starts; ``token`` is handed back
        with an overrun."""
        self._calls += 1
        self.running = (self._calls, call, token)

    def ended(self) -> None:
        """On the side that runs calls, as one returns or raises."""
        self.running = None

    async def watch(self, overran: Callable[[StageCallTimeout, Any], None]) -> None:
        """Until cancelled: call ``overran(error, token)`` (in trio) once one call has run past the deadline."""
        timeout = self.call_timeout
        period = min(timeout / 8, LOOK_PERIOD_MAX)
        seen: int | None = None
        seen_at = 0.0
        while True:
            await trio.sleep(period)
            # only the call's number is kept between looks: the call and its token held the last call's inputs
            # (a closed session's tensors) until the actor's next long call
            number = self._running_number()
            if number is None:
                seen = None
                continue
            now = trio.current_time()
            if number != seen:  # a call not seen before: its time counts from here (it may have begun a look ago)
                seen, seen_at = number, now
                continue
            if now - seen_at >= timeout and self._overran(number, timeout, overran):
                return

    def _running_number(self) -> int | None:
        running = self.running
        return None if running is None else running[0]

    def _overran(self, number: int, timeout: float, overran: Callable[[StageCallTimeout, Any], None]) -> bool:
        """Tell ``overran`` of call ``number`` if it still runs (it may have ended since the look)."""
        running = self.running
        if running is None or running[0] != number:
            return False
        _, call, token = running
        overran(StageCallTimeout(f"{_named(call)} ran past its call_timeout of {timeout:g} s"), token)
        return True


@contextlib.contextmanager
def timed(watch: CallWatch | None, call: StageInvocation | SessionContext) -> Iterator[None]:
    """The block runs ``call`` (an invocation, or a session's hook), noted as running while it does; nothing without a
    watch. (A synchronous handler's call, made for every chunk, notes itself without this.)"""
    if watch is None:
        yield
        return
    watch.started(call)
    try:
        yield
    finally:
        watch.ended()


def _named(call: StageInvocation | SessionContext) -> str:
    key = getattr(call, "key", None)
    if key is None:  # a session's hook
        return f"its session_closer for session {call.session_id!r}"
    return f"its call for session {key.session_id!r}, sequence {key.sequence_id}"

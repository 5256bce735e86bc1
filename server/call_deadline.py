"""A deadline for one of the pipeline's calls that also sees a call holding trio's thread past it.

``trio.move_on_after`` acts only when the call gives the loop back: a call that never yields (a ``time.sleep`` in an
``async def``) and returns past its deadline had no cancel to catch, and was taken as on time (a ``push_control``
20 s long left its session ``running``). :func:`call_deadline` counts it late too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["CallDeadline", "call_deadline"]


class CallDeadline:
    """What :func:`call_deadline` yields; read :attr:`missed` once the block is over."""

    def __init__(self, scope: trio.CancelScope, seconds: float) -> None:
        self._scope = scope
        self._began = trio.current_time()
        self._seconds = seconds

    @property
    def cut(self) -> bool:
        """The call was cut at its deadline (it did not return)."""
        return self._scope.cancelled_caught

    @property
    def missed(self) -> bool:
        """The call was cut at its deadline, or returned past it."""
        return self._scope.cancelled_caught or trio.current_time() - self._began >= self._seconds


@contextmanager
def call_deadline(seconds: float) -> Iterator[CallDeadline]:
    """``with call_deadline(s) as deadline: await call()``, then ``deadline.missed``."""
    with trio.move_on_after(seconds) as scope:
        yield CallDeadline(scope, seconds)

"""Time that trio's loop was held, kept out of the deadlines the server gives its clients.

Code that never awaits (a pipeline's synchronous hook run on trio's thread) holds the loop: nothing is read,
written or answered meanwhile, and every client deadline that fell inside the hold fired the moment the loop ran
again, blaming clients for the server's own pause: a request body that had arrived in time was answered 408, a
create held past the answer deadline 504 while its handler made the session, a peer that answered every ping was
closed as silent, a client that read every byte was closed for not reading.

:class:`LoopHolds`, a trio instrument (one a run: :func:`loop_holds`), times each batch of task steps; a batch that
ran longer than :data:`HELD_LATE` counts as a hold, and so does a wait for I/O that outlasted its timeout by that
much (the process was not run: SIGSTOP, a paused VM). Its :meth:`~LoopHolds.now` is trio's clock with the holds taken
out, and the cancel scopes it makes (:meth:`~LoopHolds.deadline`) move on by each hold before trio looks at its
deadlines again, so none of them fires for time the loop was held.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Final

import trio

__all__ = ["HELD_LATE", "LoopHolds", "loop_holds"]

#: seconds one batch of task steps may run before it counts as a hold (a normal batch runs for microseconds)
HELD_LATE: Final = 1.0

_CURRENT: trio.lowlevel.RunVar[LoopHolds] = trio.lowlevel.RunVar("chunkline_loop_holds")


class LoopHolds(trio.abc.Instrument):
    """The holds of one trio run, and the deadlines kept clear of them."""

    def __init__(self, late: float = HELD_LATE) -> None:
        self.late = late
        self.held = 0.0  # seconds the loop was held in all, since the watch began
        self._batch_began: float | None = None
        self._wait_began: float | None = None  # when trio began to wait for I/O (a wait far past its timeout is held)
        self._scopes: dict[trio.CancelScope, float] = {}  # each deadline kept clear, and when it was made

    # -- the instrument ---------------------------------------------------------------------

    # A hold is measured on the real clock: a mock clock's jumps (between these two calls, when the run is idle)
    # are not holds, and a mock clock does not move while code holds the loop.

    def after_io_wait(self, timeout: float) -> None:
        now = time.perf_counter()
        if self._wait_began is not None and now - self._wait_began - timeout > self.late:
            # the wait outlasted its timeout: the process did not run (SIGSTOP, a paused VM), and what came
            # meanwhile is unread; a peer that answered every ping was closed as silent as it went on
            self._held_for(now - self._wait_began, now)
        self._wait_began = None
        self._batch_began = now  # trio looks at its deadlines next, then runs a batch

    def before_io_wait(self, timeout: float) -> None:
        now = time.perf_counter()
        began, self._batch_began, self._wait_began = self._batch_began, None, now
        if began is not None and now - began > self.late:
            self._held_for(now - began, now)

    def _held_for(self, seconds: float, now: float) -> None:
        self.held += seconds
        for scope, made in self._scopes.items():  # before trio looks at the deadlines again
            scope.deadline += min(seconds, now - made)  # one made during the hold moves on by what was left of it

    # -- for the server ---------------------------------------------------------------------

    def now(self) -> float:
        """trio's clock with the holds taken out: what a client's deadline counts."""
        return trio.current_time() - self.held

    @contextlib.contextmanager
    def deadline(self, due: float) -> Iterator[trio.CancelScope]:
        """A cancel scope that ends at ``due`` on :meth:`now`'s clock (``math.inf``: never), moved on by each hold."""
        scope = trio.CancelScope(deadline=due + self.held)
        self._scopes[scope] = time.perf_counter()
        try:
            with scope:
                yield scope
        finally:
            del self._scopes[scope]

    def after(self, seconds: float) -> contextlib.AbstractContextManager[trio.CancelScope]:
        """:meth:`deadline` ``seconds`` from now."""
        return self.deadline(self.now() + seconds)

    async def sleep_until(self, due: float) -> None:
        """Sleep until ``due`` on :meth:`now`'s clock."""
        with self.deadline(due):
            await trio.sleep_forever()


def loop_holds() -> LoopHolds:
    """This trio run's watch, started on first use."""
    try:
        return _CURRENT.get()
    except LookupError:
        holds = LoopHolds()
        trio.lowlevel.add_instrument(holds)
        _CURRENT.set(holds)
        return holds

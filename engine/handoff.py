"""What a completion made on a stage's own thread leaves for the trio thread.

The scheduler core completes a successful invocation on the stage's thread and admits
what that unblocks right there, so a chunk's hop to the next stage is one thread
wake-up. Some of what follows may only happen in trio: waking trio tasks, starting a
failed session's background cleanup, submitting to an actor that takes work in trio.
While a thread is in the core, :class:`TrioHandoff` collects those; afterwards the
thread hands them to trio as one call, or nothing at all when nothing was collected
(the trio thread is then not woken).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import outcome

from .home_thread import HomeThread
from .threads import WaitQueue

if TYPE_CHECKING:
    from .actors import StageInvocation
    from .core import SchedulerCore
    from .runtime import SessionRuntime

__all__ = ["CoreCompletion", "Leftovers", "TrioHandoff"]

# What a stage's thread left for trio: the wait queues to wake, the failed sessions whose
# cleanup to start, the stages (a bit mask) to admit to from trio.
Leftovers = tuple[set[WaitQueue], list["SessionRuntime"], int]


class CoreCompletion:
    """The completion callback the core gives actors: call it in trio, or ``from_thread`` on a stage's thread.

    Called from any other thread (an actor of one's own that completes from a thread it started), it raises
    :class:`~engine.errors.WrongThreadError` and changes nothing: the core's trio side is not thread-safe, and such a
    call had corrupted a wait queue and ended the run in a ``TrioInternalError``.
    """

    __slots__ = ("_core", "_home", "from_thread")

    def __init__(self, core: SchedulerCore) -> None:
        self._core = core
        self._home = HomeThread()  # made in the trio run, with the core
        # ``from_thread(invocation, value)`` -> what trio must then run, or None: the core's own
        # method, bound once (it runs for every call a stage's thread completes)
        self.from_thread: Callable[[StageInvocation, Any], Callable[[], None] | None] = core.complete_from_thread

    def __call__(self, invocation: StageInvocation, result: outcome.Outcome) -> None:
        self._home.check("a stage actor's completion callback", "on_done")
        self._core.complete(invocation, result)


class TrioHandoff:
    """Does trio-only follow-ups now (in trio) or collects them (while a stage's thread is in the core).

    Used under the core's lock only.
    """

    __slots__ = ("_on_failed", "_queues", "_failed", "_stages", "off_trio")

    def __init__(self, on_failed: Callable[[SessionRuntime], None]) -> None:
        self._on_failed = on_failed  # starts a failed session's cleanup (in trio)
        self._queues: set[WaitQueue] = set()
        self._failed: list[SessionRuntime] = []
        self._stages = 0  # stages (the graph's bit mask) to admit to from trio
        self.off_trio = False  # a stage's thread is in the core

    def begin(self) -> None:
        """A stage's thread enters the core: collect from now on."""
        self.off_trio = True

    def end(self) -> Leftovers | None:
        """The thread leaves the core: what trio must then run (see :meth:`run`), or None."""
        self.off_trio = False
        if not (self._queues or self._failed or self._stages):
            return None
        left = (self._queues, self._failed, self._stages)
        self._queues, self._failed, self._stages = set(), [], 0
        return left

    def run(self, left: Leftovers, pump: Callable[[int], None]) -> None:
        """In trio, under the core's lock: what a thread left (:meth:`end`)."""
        queues, failed, stages = left
        for queue in queues:
            queue.wake()
        for rt in failed:
            self._on_failed(rt)
        if stages:
            pump(stages)

    def wake(self, queue: WaitQueue) -> None:
        """Wake a wait queue's parked tasks (only ever asked for one that has waiters)."""
        if self.off_trio:
            self._queues.add(queue)
        else:
            queue.wake()

    def clean_up(self, rt: SessionRuntime) -> None:
        """Start a failed session's background cleanup."""
        if self.off_trio:
            self._failed.append(rt)
        else:
            self._on_failed(rt)

    def submit_in_trio(self, stage_bit: int) -> None:
        """A stage (its bit) whose actor takes work in trio only: admit to it from trio afterwards."""
        self._stages |= stage_bit

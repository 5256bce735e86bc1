"""What the lease driver tests share (``test_lease_driver.py``, ``test_lease_rotation_and_idle.py``): the idle
timeout, a log of the lease's transitions, and a runner of one session's chunks held open by the test. The
``log`` fixture is in this package's ``conftest.py``.
"""

from __future__ import annotations

import trio
import trio.testing

from pipelines.lease import EVENT_NAMES, ExecutionLease, LeaseClosed
from states.lease import State

IDLE = 1.0


class Log:
    def __init__(self) -> None:
        self.items: list[tuple[float, str, State]] = []

    def __call__(self, transition) -> None:
        self.items.append((trio.current_time(), transition.session_id, transition.state))

    def events(self, session_id: str | None = None) -> list[tuple[str, str]]:
        """(session, lease_<event>) for the states the server publishes."""
        return [
            (sid, EVENT_NAMES[state])
            for _, sid, state in self.items
            if state in EVENT_NAMES and (session_id is None or sid == session_id)
        ]

    def clear(self) -> None:
        self.items.clear()


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


class Runner:
    """A task that runs chunks of one session, each held open until released by the test."""

    def __init__(self, lease: ExecutionLease, session_id: str) -> None:
        self.lease = lease
        self.session_id = session_id
        self.started = 0  # chunks entered
        self.finished = 0  # chunks left
        self.release = trio.Event()
        self.entered = trio.Event()
        self.error: BaseException | None = None

    async def one(self) -> None:
        try:
            async with self.lease.chunk(self.session_id):
                self.started += 1
                self.entered.set()
                await self.release.wait()
            self.finished += 1
        except LeaseClosed as exc:
            self.error = exc

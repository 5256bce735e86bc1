"""A session ends within its bounds even when its room takes nothing more from the worker.

The runner's last word (``done``, ``error``) was sent shielded with no bound of its own: a room whose socket took
nothing (an agent's hub socket nobody reads) held the session draining, its slot taken, for ever, past every
deadline the cluster keeps for a drain. The last word now has LAST_WORD_TIMEOUT, within the leaving's
DISCONNECT_TIMEOUT, and a word the room did not take is said by the server (as ``chunkline-server``). Through
HTTP and the local room protocol (in-process, trio's autojump clock); the worker's room connection is the real
one, its sends made to hang once the test says so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from server.runner import DISCONNECT_TIMEOUT, LAST_WORD_TIMEOUT
from server.tokens import SERVER_STATUS_IDENTITY
from server.transport import TransportError
from spec_tests import virtual_time

from .runner_fixtures import CounterService, join, serve, settings
from .runner_fixtures import no_threads  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("no_threads")


class RoomThatTakesNothing:
    """The worker's room connection; once ``stalled``, a send never completes (until the test ends)."""

    def __init__(self, inner: Any, released: trio.Event) -> None:
        self.inner = inner
        self.released = released
        self.stalled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def send_data(self, topic: str, payload: bytes, *, reliable: bool = True, to: str | None = None) -> None:
        if self.stalled:
            await self.released.wait()
            raise TransportError("the room took nothing")
        await self.inner.send_data(topic, payload, reliable=reliable, to=to)


@asynccontextmanager
async def released_at_the_end(released: trio.Event) -> AsyncIterator[None]:
    try:
        yield
    finally:
        released.set()  # a runner that waits for ever can stop, so that the server does


@asynccontextmanager
async def served_with_rooms_that_stall(
    service: CounterService, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Any, list[RoomThatTakesNothing]]]:
    """The server of ``service``, each worker room connection it makes one the test can stall (``stalled``)."""
    released, rooms = trio.Event(), []
    async with serve(settings(), service) as s, released_at_the_end(released):
        connect = s.runtime.transport.connect

        async def connect_to_a_room_that_stalls(*args: Any, **kwargs: Any) -> RoomThatTakesNothing:
            rooms.append(RoomThatTakesNothing(await connect(*args, **kwargs), released))
            return rooms[-1]

        monkeypatch.setattr(s.runtime.transport, "connect", connect_to_a_room_that_stalls)
        yield s, rooms


async def test_a_room_that_takes_no_last_word_does_not_hold_the_session(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert LAST_WORD_TIMEOUT < DISCONNECT_TIMEOUT
    async with served_with_rooms_that_stall(CounterService(), monkeypatch) as (s, rooms):
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            (room,) = rooms
            room.stalled = True
            deleted = trio.current_time()
            status, _ = await s.json("delete", f"/v1/stream/sessions/{session_id}")
            assert status == 200
            await virtual_time.elapse_until(deleted + DISCONNECT_TIMEOUT)
            await wait_all_tasks_blocked()
            view = await s.get(session_id)
            assert view["status"] == "closed" and view["drain_cause"] == "deleted", view
            assert s.free_slots() == 1 and not s.runtime.runners
            # the worker could not say it: the server did
            (done,) = await ctl.wait_for(lambda p: p.status("done"), "done")
            assert done["reason"] == "deleted"
            said = [m for m in ctl.texts() if m.get("type") == "data" and m["payload"].get("type") == "done"]
            assert [m["from"] for m in said] == [SERVER_STATUS_IDENTITY]


class CloseFails(CounterService):
    async def close_session(self, session_id: str) -> None:
        raise RuntimeError("the model's slot would not free")


async def test_the_servers_last_word_for_a_failure_after_a_drain_is_the_runners(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session deleted whose pipeline session then fails to close ends with ``error`` ``session_failed`` when its
    runner says it. Where the room took nothing from the runner, the server said it with its own rule: ``error``
    with the drain cause, ``deleted``, as though deleting it were the failure. Both say it one way now."""
    async with served_with_rooms_that_stall(CloseFails(), monkeypatch) as (s, rooms):
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            (room,) = rooms
            room.stalled = True
            status, _ = await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
            assert status == 200
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "the server's last word")
            assert error["reason"] == "session_failed", error
            assert "closing the pipeline session failed" in error["detail"], error
            said = [m for m in ctl.texts() if m.get("type") == "data" and m["payload"].get("type") == "error"]
            assert [m["from"] for m in said] == [SERVER_STATUS_IDENTITY]

"""Until its controller has come, a session is governed by the controller's deadline alone, whatever viewers do.

A viewer that joined and left before the controller came started the room-empty timeout, and with the defaults
(controller 60 s, room empty 30 s) it passed first: 30 s later the session was ``closed`` as ``room_empty``, a
normal end, with no pipeline session, its controller still on its way. Anyone with a viewer token could end a
session before its controller came (``states/room_presence.py``). Through HTTP and the local room protocol
(in-process, trio's autojump clock): the session waits for its controller until ``controller_timeout`` and then
fails ``controller_absent``, the viewer then in the room told so; a controller that comes late still gets its
session.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from server.settings import ServerSettings
from spec_tests import virtual_time

from .runner_fixtures import CounterService, Peer, Served, join, serve, settings
from .runner_fixtures import no_threads  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("no_threads")

CONTROLLER_TIMEOUT = attrs.fields(ServerSettings).controller_timeout.default  # 60 s
ROOM_EMPTY_TIMEOUT = attrs.fields(ServerSettings).room_empty_timeout.default  # 30 s


def with_the_defaults() -> ServerSettings:
    return settings(controller_timeout=CONTROLLER_TIMEOUT, room_empty_timeout=ROOM_EMPTY_TIMEOUT)


async def joined(peer: Peer) -> None:
    await peer.wait_for(lambda p: any(m.get("type") == "joined" for m in p.texts()), "the join")


async def come_and_go(served: Served, created: dict[str, Any], identity: str) -> None:
    """A viewer gets a token, joins the room and leaves it."""
    async with join(served, created["room"], await served.viewer_token(created["session_id"], identity)) as viewer:
        await joined(viewer)
    await wait_all_tasks_blocked()


async def test_a_viewer_who_came_and_went_before_the_controller_does_not_end_the_session(autojump_clock: Any) -> None:
    assert (CONTROLLER_TIMEOUT, ROOM_EMPTY_TIMEOUT) == (60.0, 30.0)
    service = CounterService()
    async with serve(with_the_defaults(), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        session_id = created["session_id"]
        await wait_all_tasks_blocked()
        await come_and_go(s, created, "passer")
        emptied = trio.current_time()
        await virtual_time.elapse_until(emptied + ROOM_EMPTY_TIMEOUT + 5)
        await wait_all_tasks_blocked()
        view = await s.get(session_id)
        assert view["status"] == "joining_room" and view["drain_cause"] is None, view  # still waiting for "ctl"
        async with join(s, created["room"], await s.viewer_token(session_id, "watcher")) as watcher:
            await joined(watcher)
            (error,) = await watcher.wait_for(lambda p: p.status("error"), "the error",
                                              timeout=start + CONTROLLER_TIMEOUT + 5 - trio.current_time())
            assert trio.current_time() >= start + CONTROLLER_TIMEOUT
            assert error["reason"] == "controller_absent", error
        view = await s.get(session_id)
        assert view["status"] == "failed" and view["drain_cause"] == "controller_absent", view
        assert view["error"] == "the controller 'ctl' did not join within 60 s"
        assert not service.sessions and s.free_slots() == 1


async def test_a_controller_that_comes_after_viewers_came_and_went_gets_its_session(autojump_clock: Any) -> None:
    """The room emptied again and again, each time for longer than the room-empty timeout: none of it counts
    before the controller came; it comes within its own timeout and its session runs."""
    service = CounterService()
    async with serve(settings(controller_timeout=60, room_empty_timeout=5), service) as s:
        start = trio.current_time()
        created = await s.create("ctl")
        session_id = created["session_id"]
        await wait_all_tasks_blocked()
        for index in range(4):
            await come_and_go(s, created, f"passer-{index}")
            await virtual_time.elapse(10)  # twice the room-empty timeout, the room empty
        assert trio.current_time() < start + 60
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            view = await s.get(session_id)
            assert view["status"] == "running" and view["drain_cause"] is None, view
        assert list(service.sessions) and not ctl.status("error")

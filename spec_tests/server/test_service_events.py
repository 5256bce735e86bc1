"""What a pipeline tells its session's controller through ``on_event`` (``ServiceEvent``), as the room hears it.

A lease change (``lease_queued``, ``lease_granted``, ``lease_parked``) becomes a room message of its own type. The
runner took anything whose type began with ``lease_``: another such type raised ``ValueError`` into the pipeline's own
call, and a call from a thread of the pipeline's (model code often runs on one) used trio's channel from outside trio.
Now what the room has no message for is left out, a queue position that is no place in a queue is sent as none, and a
call from any thread reaches the room in order.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from pipelines.contract import ServiceEvent, SessionConfig

from .runner_fixtures import CounterService, join, no_threads, serve, settings  # noqa: F401  (fixture)


class EventfulService(CounterService):
    """Tells its controller of lease changes as it makes a session, some of them from a thread of its own."""

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        session_id = await super().create_session(config, on_event=on_event)
        on_event(ServiceEvent(session_id, "lease_queued", {"queue_position": 2}))
        on_event(ServiceEvent(session_id, "lease_reserved", {"queue_position": 1}))  # no room message of this type
        on_event(ServiceEvent(session_id, "lease_queued", {"queue_position": "first"}))  # not a place in a queue
        on_event(ServiceEvent(session_id, "warming_up"))  # not the room's
        # the model's own thread, as a pipeline whose scheduler runs off trio's thread would call it
        await trio.to_thread.run_sync(on_event, ServiceEvent(session_id, "lease_granted", {"queue_position": 0}))
        return session_id


@pytest.mark.usefixtures("no_threads")
async def test_lease_changes_reach_the_room_and_what_it_has_no_message_for_is_left_out(autojump_clock: Any) -> None:
    service = EventfulService()
    async with serve(settings(), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            await ctl.wait_for(lambda p: p.status("lease_granted"), "the lease granted from the pipeline's thread")
            leases = [(p["type"], p["queue_position"]) for p in ctl.status() if p["type"].startswith("lease_")]
            assert leases == [("lease_queued", 2), ("lease_queued", None), ("lease_granted", 0)]
            assert not ctl.status("error")
            assert (await s.get(created["session_id"]))["status"] == "running"
            await ctl.wait_for(lambda p: len(p.frames()) >= 2, "frames after the events")

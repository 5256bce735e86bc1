"""What a pipeline tells its session's controller through ``on_event`` (``ServiceEvent``), as the room hears it.

A lease change (``lease_queued``, ``lease_granted``, ``lease_parked``) becomes a room message of its own type. The
runner took anything whose type began with ``lease_``: another such type raised ``ValueError`` into the pipeline's own
call, and a call from a thread of the pipeline's (model code often runs on one) used trio's channel from outside trio.
Now what the room has no message for is left out, a queue position that is no place in a queue is sent as none, and a
call from any thread reaches the room in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pipelines.contract import ServiceEvent, SessionConfig
from server.process_service import start_process_service

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


class WrongEventService(CounterService):
    """Hands its ``on_event`` sink what is no ``ServiceEvent`` (a dict, as a room message looks), from ``where``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        session_id = await super().create_session(config, on_event=on_event)
        wrong = {"type": "lease_granted", "queue_position": 0}
        if self.where == "trio":
            on_event(wrong)
        else:  # the model's own thread
            await trio.to_thread.run_sync(on_event, wrong)
        return session_id


@pytest.mark.usefixtures("no_threads")
@pytest.mark.parametrize("where", ["trio", "thread"])
async def test_an_event_that_is_no_service_event_is_the_pipelines_bug_named_to_the_controller(
    where: str, autojump_clock: Any
) -> None:
    """It was dropped without a word: the controller heard of no lease, and the pipeline's author of no mistake."""
    async with serve(settings(), WrongEventService(where)) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message")
        assert error["reason"] == "pipeline_failed", error
        assert "on_event takes a pipelines.contract.ServiceEvent, got dict {'type': 'lease_granted'" in error["detail"]
        assert (await s.get(created["session_id"]))["status"] == "failed"


class OtherSessionsEventService(CounterService):
    """Hands a session's ``on_event`` an event naming another session, as a control comes (a sink kept by the wrong
    key)."""

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        session_id = await super().create_session(config, on_event=on_event)
        self.sink = on_event
        return session_id

    async def push_control(self, session_id: str, control: Any) -> None:
        self.sink(ServiceEvent("counter-999", "lease_granted", {"queue_position": 0}))
        await super().push_control(session_id, control)


@pytest.mark.usefixtures("no_threads")
async def test_an_event_naming_another_session_is_the_pipelines_bug_named_to_the_controller(
    autojump_clock: Any
) -> None:
    """It was sent to this session's controller as its own lease (and a run counted it as this session's)."""
    async with serve(settings(), OtherSessionsEventService()) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            await ctl.control({"type": "control_state", "controls": ["w"]})
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message")
            assert not ctl.status("lease_granted")
        assert error["reason"] == "pipeline_failed", error
        assert ("on_event of session 'counter-1' was handed an event of session 'counter-999' ('lease_granted')"
                in error["detail"]), error


WRONG_EVENT_PIPELINE = """
from contextlib import asynccontextmanager

import numpy as np

from pipelines.contract import BidirectionalService, Chunk


class WrongEvent(BidirectionalService):
    @asynccontextmanager
    async def running(self):
        yield self

    async def create_session(self, config, *, on_event=None):
        on_event({"type": "lease_granted", "queue_position": 0})
        return "s1"

    async def push_control(self, session_id, control):
        pass

    async def chunks(self, session_id):
        yield Chunk(0, np.full((2, 16, 16, 3), 100, np.uint8), 10.0)

    async def close_session(self, session_id):
        pass


def get_service(gpu_num=0):
    return WrongEvent()
"""


OTHER_SESSIONS_EVENT_PIPELINE = WRONG_EVENT_PIPELINE.replace(
    'on_event({"type": "lease_granted", "queue_position": 0})', "self.sink = on_event"
).replace(
    "    async def chunks(self, session_id):\n",
    "    async def chunks(self, session_id):\n"
    "        from pipelines.contract import ServiceEvent\n\n"
    '        self.sink(ServiceEvent("s2", "lease_granted", {"queue_position": 0}))\n',
)


@pytest.mark.parametrize(("pipeline", "words"), [
    (WRONG_EVENT_PIPELINE, "on_event takes a pipelines.contract.ServiceEvent, got dict {'type': 'lease_granted'"),
    (OTHER_SESSIONS_EVENT_PIPELINE, "on_event of session 's1' was handed an event of session 's2' ('lease_granted')"),
], ids=["no-service-event", "another-sessions"])
async def test_an_event_that_is_the_pipelines_bug_is_named_from_a_worker_process(
        tmp_path: Path, pipeline: str, words: str) -> None:
    """Under ``--worker-mode process`` the child sealed it and the server's sink raised there: one log line, and the
    controller heard of nothing (an event naming another session: the server's sink refused it there, logged)."""
    path = tmp_path / "wrong_event.py"
    path.write_text(pipeline)
    async with serve(settings(pipeline=str(path), worker_mode="process"), start_process_service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message", timeout=60.0)
        assert error["reason"] == "pipeline_failed", error
        assert words in error["detail"], error

"""``--control-idle-timeout`` reaches the toy world's lease, and parking follows it (HTTP + room protocol).

Two sessions share one toy world worker. A's controller holds ``w`` with one
``control_state`` and then sends no heartbeat; B's controller asks to run. A is
parked, and B granted, once A has been silent for the configured timeout (at a
chunk boundary), never before: checked with 1 s (parked within a bounded real-time
watch) and with 30 s (not parked within it). The toy world computes in threads, so
these tests run on the real clock, bounded.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from pipelines.loader import load_service

from .runner_fixtures import join, serve, settings

TINY = {"height": 32, "width": 48, "frames_per_chunk": 2}


def tiny_toy_world(path: str, **options: Any) -> Any:
    """The real loader, so the server's offered settings reach ``get_service`` as they would in production."""
    return load_service("pipelines/toy_world", **options, **TINY)


def first(peer: Any, kind: str) -> Any:
    found = [m for m in peer.inbox if isinstance(m.message, dict) and m.message.get("type") == "data"
             and m.message["payload"].get("type") == kind]
    return found[0] if found else None


def lease_events(peer: Any, kind: str, *, after: float = -1.0) -> list[Any]:
    return [m for m in peer.inbox if isinstance(m.message, dict) and m.message.get("type") == "data"
            and m.message["payload"].get("type") == kind and m.at > after]


@pytest.mark.parametrize(("timeout", "watch"), [(1.0, 6.0), (30.0, 4.0)])
async def test_a_silent_holder_is_parked_after_the_configured_control_idle_timeout(timeout, watch):
    """Real time, bounded: with 1 s A is parked within the watch; with 30 s it is not (it would be at 30 s)."""
    config = settings(pipeline="pipelines/toy_world", max_sessions_per_worker=2, queue_size=0,
                      control_idle_timeout=timeout)
    async with serve(config, tiny_toy_world) as s:
        service = s.runtime.workers["worker-0"].service
        assert service.control_idle_timeout == timeout and service.lease_idle_timeout == timeout  # it reached the lease
        a = await s.create("ctl-a")
        b = await s.create("ctl-b")
        async with join(s, a["room"], a["token"]) as ctl_a, join(s, b["room"], b["token"]) as ctl_b:
            await ctl_a.wait_for(lambda p: p.status("chunk"), "a's preview chunk")
            await ctl_b.wait_for(lambda p: p.status("chunk"), "b's preview chunk")
            await ctl_a.control({"type": "control_state", "controls": ["w"]})  # held, never refreshed
            silent_from = trio.current_time()
            await ctl_a.wait_for(lambda p: len(p.status("chunk")) > 3, "a to run with w held")
            await ctl_b.control({"type": "control_state", "controls": ["d"]})
            await ctl_b.wait_for(lambda p: lease_events(p, "lease_queued", after=silent_from), "b to queue behind a")
            with trio.move_on_at(silent_from + watch):  # bench-cost: a bounded real-time watch
                await ctl_a.wait_for(lambda p: lease_events(p, "lease_parked", after=silent_from), "a's park",
                                     timeout=watch)
            parked = lease_events(ctl_a, "lease_parked", after=silent_from)
            if timeout < watch:
                assert parked, "a was not parked although it was silent past the timeout"
                assert parked[0].at - silent_from >= timeout
                granted = await ctl_b.wait_for(lambda p: lease_events(p, "lease_granted", after=silent_from),
                                               "b to be granted")  # (each peer hears it at its own moment)
                assert granted
                # a still holds w, but without a new control it does not queue again (no alternation)
                await trio.sleep(2 * timeout)  # bench-cost: a real-time watch that no re-queue happens
                assert lease_events(ctl_a, "lease_queued", after=parked[0].at) == []
                await ctl_a.control({"type": "control_state", "controls": ["w"]})  # a heartbeat: a new control
                assert await ctl_a.wait_for(lambda p: lease_events(p, "lease_queued", after=parked[0].at),
                                            "a to queue again on its new control")
            else:
                assert parked == [] and lease_events(ctl_b, "lease_granted", after=silent_from) == []


async def test_default_fps_reaches_a_pipeline_that_takes_one():
    config = settings(pipeline="pipelines/toy_world", max_sessions_per_worker=1, queue_size=0, default_fps=24)
    async with serve(config, tiny_toy_world) as s:
        assert s.runtime.workers["worker-0"].service.config.fps == 24.0
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            (chunk, *_) = await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
        assert chunk["data"]["fps"] == 24.0

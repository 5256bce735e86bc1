"""What a service says of itself is taken at its word: a ``failure`` said while ``running()`` stays open fails its
worker with those words, and a memory report that is not one fails the load naming it.

The contract has such a service leave ``running()`` with the error; one that did not (a ``failure`` property that
turns non-None while the service goes on) left its worker counted failed (health ``unhealthy``, every create a 503
``no worker is running or starting``) with its slot ``running``, no reason anywhere, its session streaming on, never
replaced; the cause ("GPU on fire") was said nowhere. Now the worker leaves ``running()`` after
:data:`server.model_worker.SERVICE_FAILURE_GRACE`, failing with the service's words: its sessions fail with them, its
slot says them, and a replacement loads. Through the app's HTTP API and the local room protocol, on virtual time.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from server.model_worker import FAILURE_LOOK, SERVICE_FAILURE_GRACE

from .runner_fixtures import CounterService, join, no_threads, serve, settings, wait_until  # noqa: F401


class SaysItFailed(CounterService):
    """Its ``failure`` says so while ``broken`` (or, ``raising``, the property raises); ``running()`` goes on
    regardless."""

    def __init__(self, raising: bool = False) -> None:
        super().__init__()
        self.broken = False
        self.raising = raising

    @property
    def failure(self) -> object | None:
        if self.broken and self.raising:
            raise RuntimeError("GPU on fire")
        return "GPU on fire" if self.broken else None


@pytest.mark.usefixtures("no_threads")
@pytest.mark.parametrize("raising", [False, True], ids=["says", "property-raises"])
async def test_a_service_that_says_it_failed_and_stays_in_running_fails_its_worker_with_its_words(
    raising: bool, autojump_clock: Any
) -> None:
    """A ``failure`` property that raises says the service is broken, in its error's words (it was taken as ``None``:
    the worker served on, healthy, with no word of it)."""
    service = SaysItFailed(raising)
    async with serve(settings(queue_size=0), service) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            service.broken = True
            said_at = autojump_clock.current_time()
            await trio.sleep(2 * FAILURE_LOOK)  # bench-cost: virtual (autojump): within the grace
            status, body = await s.json("post", "/v1/stream/sessions", json={"identity": "other"})
            said = "its failure property raised RuntimeError: GPU on fire" if raising else "GPU on fire"
            assert status == 503 and f"worker-0: its service says it failed ({said})" in body["detail"], body
            slot = s.runtime.health()["worker_slots"]["worker-0"]  # it said "running", with no reason
            assert slot["reason"] == f"its service says it failed ({said})", slot
            (error,) = await ctl.wait_for(lambda p: p.status("error"), "an error message",
                                          timeout=SERVICE_FAILURE_GRACE + 30)
        took = autojump_clock.current_time() - said_at
        assert "GPU on fire" in error["detail"], error
        assert SERVICE_FAILURE_GRACE <= took <= SERVICE_FAILURE_GRACE + 2 * FAILURE_LOOK + 5, took
        view = await s.get(created["session_id"])
        assert view["status"] == "failed" and "GPU on fire" in view["error"], view
        slot = s.runtime.health()["worker_slots"]["worker-0"]
        assert "GPU on fire" in (slot["reason"] or ""), slot
        service.broken = False  # the replacement (the same service object here) is well
        await wait_until(lambda: s.runtime.health()["status"] == "healthy", "a replacement worker")
        again = await s.create("ctl-2")
        async with join(s, again["room"], again["token"]) as ctl2:
            await ctl2.wait_for(lambda p: len(p.status("chunk")) >= 2, "chunks of the next session")


class ReportsADict(CounterService):
    def memory_report(self) -> Any:
        return {"snapshots": []}


@pytest.mark.usefixtures("no_threads")
async def test_a_memory_report_that_is_not_one_fails_the_load_naming_what_it_was(autojump_clock: Any) -> None:
    """It failed the load in Python's words: ``AttributeError: 'dict' object has no attribute 'snapshots'``."""
    async with serve(settings(max_sessions_per_worker="auto"), ReportsADict(), ready=False) as s:

        def said() -> str:
            return s.runtime.health()["worker_slots"]["worker-0"]["reason"] or ""

        await wait_until(lambda: "memory_report" in said(), "the slot to say why the worker failed")
        assert ("pipeline bug: memory_report() returned dict, not a pipelines.contract.MemoryReport (or None)"
                in said()), said()

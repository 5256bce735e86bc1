"""Stage code runs on threads that ask for the least timer slack.

Linux may end a thread's timed wait up to its timer slack late (50 us by default); a
handler's ``time.sleep`` or timed accelerator poll would add that to every chunk, at
every stage. The handlers here read their own thread's slack, as model code would see it.
"""

from __future__ import annotations

import sys

import pytest
import trio

from engine import LocalStageActor, open_orchestrator
from engine.timer_slack import STAGE_TIMER_SLACK_NS

from .conftest import canonical_spec, chunk
from .worker_ranks import thread_timer_slack_ns

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")


async def test_every_stage_handler_runs_with_the_least_timer_slack():
    seen: dict[str, int | None] = {}

    def stage(name: str, produces: str):
        def handler(inv):
            seen[name] = thread_timer_slack_ns()
            return {produces: inv.key.sequence_id}
        return LocalStageActor(handler, name=name)

    actors = {"encode": stage("encode", "condition"), "denoise": stage("denoise", "latent"),
              "decode": stage("decode", "frames")}
    trio_thread_slack = thread_timer_slack_ns()
    async with open_orchestrator(canonical_spec(), actors) as orch:
        session = orch.create_session("s", final_sequence_id=0)
        assert session.try_push(0, chunk(0))
        with trio.fail_after(30):
            outputs = [item async for item in session.outputs()]
        await session.aclose()
    assert len(outputs) == 1
    assert thread_timer_slack_ns() == trio_thread_slack  # the caller's thread keeps its own: only stage threads ask
    assert seen == {"encode": STAGE_TIMER_SLACK_NS, "denoise": STAGE_TIMER_SLACK_NS, "decode": STAGE_TIMER_SLACK_NS}


def test_a_worker_rank_runs_with_the_least_timer_slack(groups):
    group = groups(world_size=1).start()
    assert group.call("info")()["timer_slack_ns"] == STAGE_TIMER_SLACK_NS

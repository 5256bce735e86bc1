"""``chunkline_sessions{status}`` follows every move of a session at once, as ``GET`` tells it.

It was set by the once-a-second sweep and by a few events only: right after a create the gauge said ``assigned``
while the session was ``joining_room``, and ``joining_room`` for up to half a second after the controller joined and
the session ran. On a clock that does not move here, so no sweep runs.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from .runner_fixtures import CounterService, join, no_threads, serve, settings  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("no_threads")


def gauge(text: str) -> dict[str, float]:
    """The ``chunkline_sessions`` gauge's statuses with a count above 0."""
    found = re.findall(r'^chunkline_sessions\{status="([a-z_]+)"\} ([0-9.]+)$', text, re.MULTILINE)
    return {status: float(count) for status, count in found if float(count) > 0}


async def test_the_sessions_gauge_follows_each_move_at_once(mock_clock: Any) -> None:
    async with serve(settings(), CounterService()) as s:
        created = await s.create("ctl")
        status = (await s.get(created["session_id"]))["status"]
        assert gauge(await s.metrics_text()) == {status: 1.0}
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            assert (await s.get(created["session_id"]))["status"] == "running"
            assert gauge(await s.metrics_text()) == {"running": 1.0}
        await s.json("delete", f"/v1/stream/sessions/{created['session_id']}")
        ended = (await s.get(created["session_id"]))["status"]
        assert gauge(await s.metrics_text()) == {ended: 1.0}

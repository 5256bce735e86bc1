"""The authority's last log line of a shutdown counts as drained only the sessions whose drain settled as a drain does.

A session whose agent was lost during the shutdown's drain (frozen: its heartbeat deadline passed) fails with
``worker lost: ...``, and the line said ``1 session(s) drained``; it says ``0 session(s) drained, ..., 1 lost with
their worker`` now. A real authority and an external agent (processes).
"""

from __future__ import annotations

import signal

import httpx
import trio

from .conftest import Controller, external_agent, stopped

EXIT_BOUND = 60.0  # wall seconds: the drain waits for the frozen agent's heartbeat deadline (4 s), then exits


async def test_a_session_lost_with_its_agent_during_the_shutdown_is_not_counted_drained() -> None:
    async with external_agent() as (authority, agent):
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
            controller = await Controller.open(client, authority, "alice")
            await controller.stream(2)
        with stopped(agent.popen.pid):  # it answers nothing more: the drain cannot settle but by its loss
            authority.process.popen.send_signal(signal.SIGTERM)
            code = await trio.to_thread.run_sync(authority.process.popen.wait, EXIT_BOUND)
        await controller.ws.aclose()
        log = authority.process.text(200_000)
    assert code == 0, log
    assert "lost: heartbeat missed" in log, log
    assert ("shutdown complete: 0 session(s) drained, 0 stopped at once past the grace, 1 lost with their worker"
            in log), log

"""The authority's last log line of a shutdown counts as drained only the sessions whose drain settled as a drain does.

A session whose agent was lost during the shutdown's drain (frozen: its heartbeat deadline passed) fails with
``worker lost: ...``, and the line said ``1 session(s) drained``; it says ``0 session(s) drained, ..., 1 lost with
their worker`` now. A real authority and an external agent (processes).
"""

from __future__ import annotations

import os
import signal

import httpx
import trio

from .conftest import TINY, TOKEN, Controller, Process, chunkline, clean_env, start_authority, until

EXIT_BOUND = 60.0  # wall seconds: the drain waits for the frozen agent's heartbeat deadline (4 s), then exits


async def test_a_session_lost_with_its_agent_during_the_shutdown_is_not_counted_drained() -> None:
    authority = await trio.to_thread.run_sync(lambda: start_authority(launcher="external", workers=1))
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    frozen = False
    try:
        await until(authority.eligible, "the external agent to be ready", authority)
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
            controller = await Controller.open(client, authority, "alice")
            await controller.stream(2)
        os.kill(agent.popen.pid, signal.SIGSTOP)  # it answers nothing more: the drain cannot settle but by its loss
        frozen = True
        authority.http.close()
        authority.process.popen.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(authority.process.popen.wait, EXIT_BOUND)
        await controller.ws.aclose()
    finally:
        if frozen:
            os.kill(agent.popen.pid, signal.SIGCONT)
        agent.stop()
        authority.process.stop()
    log = authority.process.text(200_000)
    assert code == 0, log
    assert "lost: heartbeat missed" in log, log
    assert ("shutdown complete: 0 session(s) drained, 0 stopped at once past the grace, 1 lost with their worker"
            in log), log

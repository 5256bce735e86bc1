"""An authority that stalls itself (SIGSTOP past its heartbeat deadline, then SIGCONT) names its own stall as the cause
of the losses it brings about, not the agents.

Its agents had no heartbeat acknowledged, fenced themselves and closed their connections; running again, the authority
found them overdue or gone, and the sessions on them failed with ``worker lost: heartbeat missed``, which blamed the
agents. They fail with ``worker lost: the authority stalled for N s ...`` now, counted under ``authority_stalled``.
A real authority and an external agent (processes).
"""

from __future__ import annotations

import os
import signal

import httpx
import trio

from .conftest import DEADLINE, TINY, TOKEN, Controller, Process, chunkline, clean_env, start_authority, until
from .test_agent_start_signals import logged

FENCED = "no heartbeat acknowledged"  # the agent's line as it fences itself


async def test_a_session_lost_to_the_authoritys_own_stall_names_the_stall_not_a_missed_heartbeat() -> None:
    authority = await trio.to_thread.run_sync(lambda: start_authority(launcher="external", workers=1))
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    frozen = False
    try:
        await until(authority.eligible, "the external agent to be ready", authority)
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
            controller = await Controller.open(client, authority, "alice")
            await controller.stream(2)
            os.kill(authority.process.popen.pid, signal.SIGSTOP)
            frozen = True
            await logged(agent, FENCED, 30)
            await trio.sleep(DEADLINE)  # bench-cost: the stall outlasts the authority's heartbeat deadline, as in the field
            os.kill(authority.process.popen.pid, signal.SIGCONT)
            frozen = False

            async def ended() -> dict | None:
                record = (await client.get(f"/v1/stream/sessions/{controller.session_id}")).json()
                return record if record["status"] == "failed" else None

            record = await until(ended, "the session to fail", authority, deadline=30)
            await controller.ws.aclose()
        assert record["error"].startswith("worker lost: the authority stalled for "), record
        assert "the agent was fenced by the stall" in record["error"] and "heartbeat" not in record["error"], record
        metrics = authority.http.get("/metrics").text
        assert 'chunkline_worker_losses_total{cause="authority_stalled"} 1.0' in metrics, metrics
        assert "cluster: the authority stalled for " in authority.process.text(200_000)
    finally:
        if frozen:
            os.kill(authority.process.popen.pid, signal.SIGCONT)
        agent.stop()
        await trio.to_thread.run_sync(authority.stop)

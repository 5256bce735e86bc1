"""An authority that stalls itself (SIGSTOP past its heartbeat deadline, then SIGCONT) names its own stall as the cause
of the losses it brings about, not the agents, and its agents do not count the fence it caused toward their
crash-loop limit.

Its agents had no heartbeat acknowledged, fenced themselves and closed their connections; running again, the authority
found them overdue or gone, and the sessions on them failed with ``worker lost: heartbeat missed``, which blamed the
agents. They fail with ``worker lost: the authority stalled for N s ...`` now, counted under ``authority_stalled``.
A real authority and an external agent (processes).
"""

from __future__ import annotations

import httpx
import trio

from .conftest import DEADLINE, Controller, external_agent, stopped, until
from .test_agent_start_signals import logged

FENCED = "no heartbeat acknowledged"  # the agent's line as it fences itself
UNCOUNTED = "not counted as a crash: a fence is the authority's silence or verdict"  # and as it dials again


async def test_a_session_lost_to_the_authoritys_own_stall_names_the_stall_not_a_missed_heartbeat() -> None:
    async with external_agent() as (authority, agent), httpx.AsyncClient(base_url=authority.base_url,
                                                                                    timeout=10) as client:
        controller = await Controller.open(client, authority, "alice")
        await controller.stream(2)
        with stopped(authority.process.popen.pid):
            await logged(agent, FENCED, 30)
            await trio.sleep(DEADLINE)  # bench-cost: the stall outlasts the authority's heartbeat deadline, as in the field

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
        # the fence is the authority's doing, not the agent's crash, also with a session running on the agent (its
        # count of stopped sessions, added to the words of the end, made the end read as a lost connection: counted,
        # nine such stalls or authority restarts in a minute ended the agent for good)
        await logged(agent, UNCOUNTED, 30)
        assert "authority connection ended" not in agent.text(200_000), agent.text(200_000)

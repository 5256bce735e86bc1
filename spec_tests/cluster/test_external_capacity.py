"""The authority's ``--max-sessions-per-worker`` holds for an external agent too: the agent reports its own plan's
capacity (the tiny world's memory plan allows dozens), and the authority admits at most its own limit on it. It
took the agent's word: with ``--max-sessions-per-worker 1`` two sessions ran on the one agent while metadata said
``configured_max_sessions_per_worker: 1``."""

from __future__ import annotations

import httpx

from .conftest import TINY, TOKEN, Process, chunkline, clean_env, start_authority, until


async def test_an_external_agent_takes_no_more_sessions_than_the_authoritys_limit() -> None:
    authority = start_authority(launcher="external", workers=1)  # --max-sessions-per-worker 1
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    try:
        [worker] = await until(authority.eligible, "the external agent to be ready", authority)
        assert worker["capacity"] == 1, worker
        metadata = authority.get("/v1/service/metadata")
        assert metadata["max_sessions_per_worker"] == 1 == metadata["configured_max_sessions_per_worker"], metadata
        async with httpx.AsyncClient(base_url=authority.base_url, timeout=10) as client:
            first = await client.post("/v1/stream/sessions", json={"identity": "alice"})
            second = await client.post("/v1/stream/sessions", json={"identity": "bob"})
            assert first.status_code == 200, first.text
            assert second.status_code == 202 and second.json()["queue_position"] == 1, second.text
            assert authority.get("/v1/stream/health")["free_slots"] == 0
            for created in (first, second):
                await client.delete(f"/v1/stream/sessions/{created.json()['session_id']}")
    finally:
        agent.stop()
        authority.http.close()
        assert authority.process.stop() == 0, authority.process.text()

"""A create while no worker agent is registered says where agents dial.

Under ``--workers external`` the authority starts no agent of its own: until one dials in, a create is a 503 whose
detail read only "no worker is running or starting", leaving the operator to guess that agents were awaited, and
where. It names the cluster port's address, and keeps ``Retry-After`` (an agent may still join). A real authority.
"""

from __future__ import annotations

import httpx
import trio

from .conftest import start_authority


async def test_a_create_before_any_agent_registered_says_where_agents_dial() -> None:
    cluster = await trio.to_thread.run_sync(lambda: start_authority(launcher="external", workers=1))
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as client:
            refused = await client.post("/v1/stream/sessions", json={"identity": "a"})
        assert (refused.status_code, refused.json()["error"]) == (503, "no_worker"), refused.text
        assert refused.json()["detail"] == (f"no worker is running or starting (no worker agent is registered; agents "
                                            f"dial tcp://127.0.0.1:{cluster.cluster_port})"), refused.text
        assert "retry-after" in refused.headers
    finally:
        await trio.to_thread.run_sync(cluster.stop)

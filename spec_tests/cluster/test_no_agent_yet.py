"""A create while no worker agent is registered says where agents dial.

Under ``--workers external`` the authority starts no agent of its own: until one dials in, a create is a 503 whose
detail read only "no worker is running or starting", leaving the operator to guess that agents were awaited, and
where. It names the cluster port's address, and keeps ``Retry-After`` (an agent may still join). A real authority.
"""

from __future__ import annotations

import httpx
import trio

from .conftest import start_authority, until


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


async def test_a_create_after_the_only_local_agent_was_drained_says_its_slot_stays_down() -> None:
    """The slot's own reason comes first: the 503 said only that no agent was registered and where agents dial, as
    if one were on its way, while health said the slot was drained on purpose and is not restarted."""
    cluster = await trio.to_thread.run_sync(lambda: start_authority(launcher="local", workers=1))
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as client:
            (worker,) = await until(lambda: [w for w in cluster.workers() if w["state"] == "idle"], "a ready agent",
                                    cluster)
            drained = await client.post(f"/v1/service/workers/{worker['worker_id']}/drain", json={})
            assert drained.status_code == 202, drained.text
            await until(lambda: {s["state"] for s in cluster.get("/v1/service/metadata")["cluster"]["slots"]}
                        == {"stopped"}, "its slot to stay down, drained", cluster, deadline=60)
            refused = await client.post("/v1/stream/sessions", json={"identity": "a"})
        assert (refused.status_code, refused.json()["error"]) == (503, "no_worker"), refused.text
        detail = refused.json()["detail"]
        assert "drained" in detail and detail.index("drained") < detail.index("no worker agent is registered"), detail
    finally:
        await trio.to_thread.run_sync(cluster.stop)

"""A local agent lost while its process lives on (frozen past its heartbeat deadline) shows as ``lost`` in its slot's
health and metadata views, with when it is ended, until it registers again or is ended.

During that window (the launcher's time for it to register again, some 10 s) the slot said ``state: running`` with no
worker: a place that ran nothing read as running. A real authority and its launched agent (processes).
"""

from __future__ import annotations

from typing import Any

import trio

from .conftest import Cluster, start_cluster, stopped, until

SLOT = "local-0"


def slot_view(cluster: Cluster) -> dict[str, Any]:
    return cluster.get("/v1/stream/health")["worker_slots"][SLOT]


async def test_a_lost_local_agent_whose_process_lives_shows_lost_until_it_registers_again() -> None:
    cluster = await trio.to_thread.run_sync(lambda: start_cluster(workers=1))
    try:
        [worker] = cluster.eligible()
        with stopped(worker["pid"]):
            lost = await until(lambda: (view := slot_view(cluster))["worker_id"] is None and view,
                               "the agent to be lost", cluster, deadline=30)
            assert lost["state"] == "lost", lost
            assert lost["reason"].startswith("its agent was lost (heartbeat missed"), lost
            assert "its process lives on: ended in " in lost["reason"] and "unless it registers again" in lost["reason"]
            [metadata_slot] = cluster.get("/v1/service/metadata")["cluster"]["slots"]
            assert metadata_slot["state"] == "lost", metadata_slot
        back = await until(lambda: (view := slot_view(cluster))["worker_id"] is not None and view,
                           "the agent to register again", cluster, deadline=30)
        assert (back["state"], back["reason"]) == ("running", None), back
        assert back["restarts"] == 0, back  # the same process came back: nothing was restarted
    finally:
        await trio.to_thread.run_sync(cluster.stop)

"""The authority's settings meant for its workers reach its agents as they reach in-process workers:
``--default-fps`` and ``--control-idle-timeout`` are offered to the pipeline, and the startup check runs
(``--skip-validation`` unset) and is reported in metadata."""

from __future__ import annotations

import httpx
import trio

from .conftest import Controller, start_cluster

OFFERED_WORLD = "spec_tests/cluster/offered_world.py"


async def test_an_agents_pipeline_gets_the_authoritys_fps_and_idle_timeout_and_runs_the_startup_check() -> None:
    cluster = start_cluster("--default-fps", "8", "--control-idle-timeout", "3", workers=1, pipeline=OFFERED_WORLD)
    try:
        [worker] = cluster.eligible()
        metadata = cluster.get("/v1/service/metadata")
        assert metadata["startup_check"] == {
            worker["worker_id"]: {"status": "passed", "frames": [3, 32, 48, 3], "fps": 8.0}
        }, metadata["startup_check"]
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
            controller = await Controller.open(client, cluster, "alice")
            with trio.fail_after(120):
                while not controller.statuses("chunk"):
                    assert await controller.next() is not None, controller.inbox[-3:]
            chunk = controller.statuses("chunk")[0]
            assert (chunk["data"]["frames"], chunk["data"]["fps"]) == (3, 8.0), chunk
            await client.delete(f"/v1/stream/sessions/{controller.session_id}")
            await controller.ws.aclose()
    finally:
        cluster.http.close()
        assert cluster.process.stop() == 0, cluster.process.text()

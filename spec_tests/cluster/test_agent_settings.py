"""The authority's settings meant for its workers reach its agents as they reach in-process workers:
``--default-fps`` and ``--control-idle-timeout`` are offered to the pipeline, and the startup check runs
(``--skip-validation`` unset) and is reported in metadata, with ``control_idle_timeout`` where the pipeline took it; an image no agent can be sent is refused up front."""

from __future__ import annotations

import base64
import struct
import zlib

import httpx
import trio

from .conftest import TOKEN, Controller, Process, chunkline, clean_env, start_authority, start_cluster, until

OFFERED_WORLD = "spec_tests/cluster/offered_world.py"


async def test_an_agents_pipeline_gets_the_authoritys_fps_and_idle_timeout_and_runs_the_startup_check() -> None:
    cluster = start_cluster("--default-fps", "8", "--control-idle-timeout", "3", workers=1, pipeline=OFFERED_WORLD)
    try:
        [worker] = cluster.eligible()
        metadata = cluster.get("/v1/service/metadata")
        assert metadata["startup_check"] == {
            worker["worker_id"]: {"status": "passed", "frames": [3, 32, 48, 3], "fps": 8.0}
        }, metadata["startup_check"]
        # its get_service takes control_idle_timeout, and the agent's Ready says so: shown as in-process
        assert metadata["control_idle_timeout"] == 3.0, metadata
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


async def test_an_external_agent_started_with_its_own_idle_timeout_is_shown_with_it_not_the_authoritys() -> None:
    """Metadata shows what an agent's pipeline runs with: its Ready carries the values it handed the pipeline (it
    named only which settings were taken, so metadata showed the authority's --control-idle-timeout instead; the
    authority now refuses that option with external agents, and shows the agent's value, not its own default)."""
    authority = start_authority(launcher="external", workers=1, pipeline=OFFERED_WORLD)
    agent = Process(chunkline("worker", OFFERED_WORLD, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}",
                              "--control-idle-timeout", "5", "--default-fps", "8"),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    try:
        [worker] = await until(authority.eligible, "the external agent to be ready", authority)
        metadata = authority.get("/v1/service/metadata")
        # its startup chunk was made with 5 (the offered world makes one frame a second of idle timeout)
        assert metadata["startup_check"][worker["worker_id"]]["frames"] == [5, 32, 48, 3], metadata["startup_check"]
        assert metadata["control_idle_timeout"] == 5.0, metadata
        assert metadata["worker_settings"] == {worker["worker_id"]: {"control_idle_timeout": 5.0, "fps": 8.0}}, metadata
    finally:
        agent.stop()
        authority.http.close()
        assert authority.process.stop() == 0, authority.process.text()


def _padded_png(size: int) -> bytes:
    """A valid 8x8 PNG followed by padding up to ``size`` bytes (the header check reads the header only)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress((b"\x00" + b"\x80" * 24) * 8)) + chunk(b"IEND", b""))
    return png + b"\x00" * (size - len(png))


async def test_an_image_too_large_for_an_agent_is_a_400_and_takes_no_slot() -> None:
    cluster = start_cluster("--max-body-bytes", str(16 * 1024 * 1024), workers=1)
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as client:
            body = {"identity": "big", "image_b64": base64.b64encode(_padded_png(9 * 1024 * 1024)).decode()}
            response = await client.post("/v1/stream/sessions", json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"] == "image_too_large" and "at most 8388608" in response.json()["detail"]
            assert (await client.get("/v1/stream/sessions")).json()["sessions"] == []
            health = (await client.get("/v1/stream/health")).json()
            assert health["retained_sessions"] == 0 and health["workers_idle"] == 1, health
            ok = await client.post("/v1/stream/sessions", json={"identity": "small",
                                                                 "image_b64": base64.b64encode(_padded_png(1024)).decode()})
            assert ok.status_code == 200, ok.text
            await client.delete(f"/v1/stream/sessions/{ok.json()['session_id']}")
    finally:
        cluster.http.close()
        assert cluster.process.stop() == 0, cluster.process.text()


async def test_an_agent_whose_pipeline_refuses_the_settings_exits_3_and_its_slot_is_not_restarted() -> None:
    """The replay pipeline pushes one session per worker: an agent given --max-sessions 2 refuses it as it loads.
    It exited 1 and its local slot restarted it with backoff until the crash-loop limit, each refusing the same
    way; it exits 3 now (a replacement would be refused too), and the launcher gives the slot up at once."""
    cluster = start_authority("--max-sessions-per-worker", "2", launcher="local", workers=1, pipeline="pipelines/replay")
    try:
        await until(lambda: b"refused its configuration" in cluster.process.raw, "the slot to give up", cluster)
        line = next(line for line in cluster.process.text().splitlines() if "refused its configuration" in line)
        # the agent's own words come back through its launcher (server/cluster/load_failures.py), then the exit code
        assert "local slot 0: refused its configuration; not restarted (ConfigurationRefused: " in line, line
        assert line.endswith("max_sessions_per_worker=2 is refused; process exited with code 3)"), line
        assert "max_sessions_per_worker=2 is refused" in cluster.process.text()
        assert "restart 1 of" not in cluster.process.text(), cluster.process.text()
    finally:
        cluster.stop()

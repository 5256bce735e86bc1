"""A worker agent keeps a session's reference image in a folder of its own; what happens to that folder on the
agent's host (a temporary-file cleaner removes it, the disk fills) ends at most the one session, never the agent.

An agent that could not write an image raised out of its connection's reader: it exited with a traceback, and every
session it ran was lost with it (an external agent is not even replaced); its folder, once a cleaner had removed it,
failed every later image.
"""

from __future__ import annotations

import resource
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from server.transport.client import RoomClient

from ..server.conftest import png_bytes
from .conftest import Cluster, Controller, start_cluster, until


async def _ended(client: httpx.AsyncClient, cluster: Cluster, session_id: str) -> dict:
    async def terminal() -> dict | None:
        record = (await client.get(f"/v1/stream/sessions/{session_id}")).json()
        return record if record["status"] in ("closed", "failed", "expired") else None

    return await until(terminal, f"session {session_id} to end", cluster, deadline=30)


async def _stream_and_end(client: httpx.AsyncClient, cluster: Cluster, identity: str, **body: str) -> Controller:
    """A session (with ``body``'s image) that runs, streams, and is deleted (its slot free again)."""
    response = await client.post("/v1/stream/sessions", json={"identity": identity, **body})
    assert response.status_code == 200, response.text
    created = response.json()
    ws = await RoomClient.connect("127.0.0.1", cluster.port, f"{created['websocket_path']}?token={created['token']}")
    controller = Controller(created, ws)
    await controller.stream(1, deadline=60)
    assert (await client.delete(f"/v1/stream/sessions/{controller.session_id}")).status_code in (200, 202, 204)
    await _ended(client, cluster, controller.session_id)
    await ws.aclose()
    return controller


async def test_an_image_the_agent_cannot_store_fails_that_session_alone_and_a_removed_folder_is_made_again(
    tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    # the cluster's TMPDIR, short: the front's Unix socket is made there, and pytest's tmp_path under xdist
    # (/tmp/pytest-of-root/pytest-N/popen-gwN/<test name>...) passes the 107 bytes an AF_UNIX path may take
    scratch = Path(tempfile.mkdtemp(prefix="cl-images-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    (assets / "street.png").write_bytes(png_bytes())
    cluster = start_cluster("--assets-dir", str(assets), workers=1, tmpdir=scratch)
    try:
        [agent] = cluster.eligible()
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
            await _stream_and_end(client, cluster, "alice", image_path="street.png")
            folders = list(scratch.glob("chunkline-agent-*"))
            assert len(folders) == 1, folders
            shutil.rmtree(folders[0])  # what systemd-tmpfiles does to a folder left idle for days
            await _stream_and_end(client, cluster, "bob", image_path="street.png")

            # the agent's disk is full: no file it writes may grow past 0 bytes (Python ignores SIGXFSZ: EFBIG)
            limits = resource.prlimit(agent["pid"], resource.RLIMIT_FSIZE)
            resource.prlimit(agent["pid"], resource.RLIMIT_FSIZE, (0, limits[1]))
            try:
                response = await client.post("/v1/stream/sessions", json={"identity": "carol", "image_path": "street.png"})
                assert response.status_code == 200, response.text
                record = await _ended(client, cluster, response.json()["session_id"])
            finally:
                resource.prlimit(agent["pid"], resource.RLIMIT_FSIZE, limits)
            assert (record["status"], record["drain_cause"]) == ("failed", "start_failed"), record
            assert record["error"] == "the worker could not store the session's image: File too large", record
            # the same agent serves on: a session without an image, then one with
            await _stream_and_end(client, cluster, "dave")
            await _stream_and_end(client, cluster, "erin", image_path="street.png")
            assert [w["worker_id"] for w in cluster.eligible()] == [agent["worker_id"]]
            assert not cluster.get("/v1/service/metadata")["cluster"]["recent_losses"]
        assert "Traceback" not in cluster.process.text(200_000)
    finally:
        cluster.stop()

"""A queued session whose reference image is gone (or swapped for a pipe) by the time a slot frees fails alone.

The authority reads a queued session's image when it promotes it to an agent (the bytes
travel in the start message). A file deleted meanwhile must fail that one session, naming
the image, and leave the authority serving and the slot free for the next session.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from ..server.conftest import png_bytes
from .conftest import Controller, start_cluster, until


async def _status(client: httpx.AsyncClient, session_id: str) -> dict:
    return (await client.get(f"/v1/stream/sessions/{session_id}")).json()


@pytest.mark.parametrize("swap", ["deleted", "pipe"])
async def test_a_queued_sessions_image_deleted_before_promotion_fails_that_session_only(swap: str, tmp_path: Path) -> None:
    """``pipe``: the file swapped for a named pipe, which reading would wait on for ever (it froze the whole
    authority: every request, the agents' heartbeats) until someone wrote into it."""
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "street.png").write_bytes(png_bytes())
    cluster = start_cluster("--assets-dir", str(assets), workers=1)
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
            holder = await Controller.open(client, cluster, "alice")
            await holder.stream(1)
            queued = await client.post("/v1/stream/sessions", json={"identity": "bob", "image_path": "street.png"})
            assert queued.status_code == 202, queued.text
            queued_id = queued.json()["session_id"]
            (assets / "street.png").unlink()
            if swap == "pipe":
                os.mkfifo(assets / "street.png")
            deleted = await client.delete(f"/v1/stream/sessions/{holder.session_id}")
            assert deleted.status_code in (200, 202, 204), deleted.text

            async def failed() -> dict | None:
                record = await _status(client, queued_id)
                return record if record["status"] in ("failed", "closed") else None

            record = await until(failed, "the queued session to fail", cluster, deadline=30)
            assert (record["status"], record["drain_cause"]) == ("failed", "start_failed"), record  # the cause was null
            assert "street.png" in record["error"] and str(assets) not in record["error"], record  # its name only
            if swap == "pipe":
                assert "not a regular file" in record["error"], record
            # the authority still serves, and the slot is free for the next one
            assert (await client.get("/v1/stream/health")).status_code == 200
            nxt = await Controller.open(client, cluster, "carol")
            assert nxt.session["status"] != "queued", nxt.session
            await nxt.stream(1)
            await holder.ws.aclose()
            await nxt.ws.aclose()
    finally:
        cluster.stop()

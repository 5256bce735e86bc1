"""Worker agents: a create that gives a session input the agents' pipeline does not take is a 400 naming it.

The authority does not import the pipeline; an agent tells it what its pipeline's service declares in its Ready
(``takes_prompt``, ``takes_image``). Before, an authority of the replay pipeline (which takes neither) took a create
with a prompt or an uploaded image, wrote the image to its upload folder, and the agent streamed the pattern
without them. A real ``chunkline stream-serve --workers local`` with one replay agent, met over HTTP.
"""

from __future__ import annotations

import base64
import shutil
import tempfile
from pathlib import Path

import httpx

from ..server.conftest import png_bytes
from .conftest import start_cluster


async def test_an_authority_refuses_a_prompt_or_an_image_its_agents_pipeline_does_not_take() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="cl-in-"))  # short: the front's Unix socket is made there
    cluster = start_cluster(workers=1, pipeline="pipelines/replay", tmpdir=scratch)
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
            for field, name, value in (("prompt", "prompt", "a snowy street"),
                                       ("image_b64", "image", base64.b64encode(png_bytes()).decode())):
                response = await client.post("/v1/stream/sessions", json={"identity": "ctl", field: value})
                assert response.status_code == 400, response.text
                assert response.json() == {
                    "error": "invalid_input",
                    "detail": f"{field}: pipeline 'pipelines/replay' takes no {name} (its service declares "
                              f"takes_{name} = False); leave it out",
                }
            assert (await client.get("/v1/stream/sessions")).json()["sessions"] == []
            health = (await client.get("/v1/stream/health")).json()
            assert health["retained_sessions"] == 0 and health["queued_sessions"] == 0, health
            assert list(scratch.glob("chunkline-uploads-*")) == []  # the upload was written there before
            taken = await client.post("/v1/stream/sessions", json={"identity": "ctl"})
            assert taken.status_code == 200, taken.text
            await client.delete(f"/v1/stream/sessions/{taken.json()['session_id']}")
    finally:
        cluster.stop()
        shutil.rmtree(scratch, ignore_errors=True)

"""A create that gives a session input the pipeline does not take is refused, never taken and ignored.

The replay pipeline streams its pattern from its options alone (``takes_prompt = takes_image = False``). A create
with ``prompt``, ``image_b64`` or ``image_path`` was taken (the image decoded and written to the upload folder) and
the pattern streamed without it; now it is a 400 ``invalid_input`` naming the field and the pipeline, with no
upload written, no session, no slot and no queue place, in-process and with the service in a child process
(``--worker-mode process``, where the parent learns the declaration from the child's hello). Each server is a real
``chunkline stream-serve`` process met over HTTP. Worker agents: ``spec_tests/cluster/test_session_inputs.py``.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest
import trio

from .conftest import GatedLoader, assert_error_body, png_bytes, serve, wait_ready
from .served_process import stream_serve

MODES = {"in-process": (), "process": ("--worker-mode", "process")}


def refusal(field: str, name: str) -> str:
    return (f"{field}: pipeline 'pipelines/replay' takes no {name} (its service declares takes_{name} = False); "
            f"leave it out")


def uploads_of(tmp: Path, pid: int) -> list[str]:
    """The upload folders server ``pid`` made in its TMPDIR (``chunkline-uploads-<pid>-*``)."""
    return [path.name for path in tmp.glob(f"chunkline-uploads-{pid}-*")]


@pytest.mark.parametrize("mode", MODES)
async def test_a_prompt_or_an_image_given_to_the_replay_pipeline_is_a_400_and_holds_nothing(
    short_tmp: Path, tmp_path: Path, mode: str
) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "scene.png").write_bytes(png_bytes())
    given = {"prompt": ("prompt", "a snowy street"), "image_b64": ("image", base64.b64encode(png_bytes()).decode()),
             "image_path": ("image", "scene.png")}
    async with stream_serve(short_tmp, "--assets-dir", str(assets), *MODES[mode]) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
            await served.wait_ready(client)
            for field, (name, value) in given.items():
                response = await client.post("/v1/stream/sessions", json={"identity": "ctl", field: value})
                assert response.status_code == 400, response.text
                assert response.json() == {"error": "invalid_input", "detail": refusal(field, name)}
            # an image it does not take is refused as that, whatever the image is: it was a 400 unsupported_image,
            # and a user who fixed the image was then told to leave it out
            garbage = await client.post("/v1/stream/sessions", json={"identity": "ctl",
                                                                      "image_b64": base64.b64encode(b"no image").decode()})
            assert garbage.json() == {"error": "invalid_input", "detail": refusal("image_b64", "image")}
            both = await client.post("/v1/stream/sessions", json={"identity": "ctl", "prompt": "x",
                                                                   "image_b64": given["image_b64"][1]})
            assert both.json()["detail"] == refusal("prompt", "prompt")  # the first the pipeline does not take
            assert (await client.get("/v1/stream/sessions")).json()["sessions"] == []
            health = (await client.get("/v1/stream/health")).json()
            assert health["retained_sessions"] == 0 and health["queued_sessions"] == 0, health
            assert uploads_of(short_tmp, served.process.pid) == []  # the image was written there before
            taken = await client.post("/v1/stream/sessions", json={"identity": "ctl", "config": {"fps": 8}})
            assert taken.status_code == 200, taken.text  # what it does take is served as before


async def test_an_input_given_before_any_worker_has_loaded_the_pipeline_is_a_503_until_one_says() -> None:
    """Nothing can say yet whether the pipeline takes the prompt: a 503 with Retry-After (as for options), not a
    session that a pipeline may then serve without it; one without inputs is taken as before."""
    loader = GatedLoader()
    async with serve(loader=loader, ready=False) as served:
        await trio.to_thread.run_sync(loader.entered.wait)
        try:
            status, body, response = await served.create(prompt="a snowy street")
            assert status == 503, body
            assert_error_body(status, body, "no_worker")
            assert "whether it takes a prompt" in body["detail"] and response.headers["Retry-After"]
            assert list(served.runtime.registry) == []
        finally:
            loader.release()
        await wait_ready(served.runtime)
        status, body, _ = await served.create(prompt="a snowy street")
        assert status == 200, body  # the toy world takes a prompt

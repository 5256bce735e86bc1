"""``GET /v1/service/metadata`` reports a setting only where it applies: ``control_idle_timeout`` (how long a
session may send no control before it steps aside) for a pipeline whose ``get_service`` takes it, ``null`` for a
server-push stream, which never gets one, and for a pipeline that takes controls but not that setting (it never
applies it) — the same in-process and with the pipeline in a worker process. It also says which session inputs
(``prompt``, ``image``) a create may give, as the pipeline declares them, or ``null`` before a worker has loaded it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pipelines.loader import load_service
from server.process_service import start_process_service
from spec_tests.security.test_hostile_server import running

from .conftest import GatedLoader, wait_ready
from .conftest import serve as serve_toy
from .runner_fixtures import serve, settings

#: a pipeline that takes controls; its get_service names control_idle_timeout or not ({signature})
PIPELINE = """
from spec_tests.server.runner_fixtures import CounterService


def get_service({signature}):
    return CounterService()
"""


async def test_a_server_push_pipeline_reports_no_control_idle_timeout() -> None:
    async with running(control_idle_timeout=7.0) as server:  # the replay stream, served for real
        status, metadata = await server.request("GET", "/v1/service/metadata")
    assert status == 200 and metadata["pipeline_kind"] == "server_push"
    assert metadata["control_idle_timeout"] is None


@pytest.mark.parametrize("loader", [load_service, start_process_service], ids=["in-process", "worker-process"])
@pytest.mark.parametrize(("signature", "shown"), [
    ("gpu_num=0, control_idle_timeout=10.0", 7.0),
    ("gpu_num=0", None),
    ("gpu_num=0, **options", None),  # **kwargs does not count: it is not handed the setting
], ids=["takes-it", "does-not-take-it", "takes-kwargs"])
async def test_a_pipeline_that_takes_controls_reports_its_control_idle_timeout_only_if_it_takes_it(
    loader: Any, signature: str, shown: float | None, tmp_path: Path
) -> None:
    path = tmp_path / "counter_pipeline.py"
    path.write_text(PIPELINE.replace("{signature}", signature))
    worker_mode = "process" if loader is start_process_service else "in-process"
    async with serve(settings(pipeline=str(path), control_idle_timeout=7.0, worker_mode=worker_mode), loader) as s:
        status, metadata = await s.json("get", "/v1/service/metadata")
    assert status == 200 and metadata["pipeline_kind"] == "bidirectional"
    assert metadata["control_idle_timeout"] == shown


#: a pipeline that declares which session inputs it takes ({declared}: class attributes, or none)
DECLARING_PIPELINE = """
from spec_tests.server.runner_fixtures import CounterService


class Declaring(CounterService):
    {declared}


def get_service(gpu_num=0):
    return Declaring()
"""


@pytest.mark.parametrize("loader", [load_service, start_process_service], ids=["in-process", "worker-process"])
@pytest.mark.parametrize(("declared", "shown"), [
    ("pass", ["prompt", "image"]),  # says nothing: takes both, as every service did before the declaration
    ("takes_image = False", ["prompt"]),
    ("takes_prompt = False", ["image"]),
    ("takes_prompt = takes_image = False", []),
], ids=["both", "prompt-only", "image-only", "neither"])
async def test_metadata_says_which_session_inputs_the_pipeline_takes(
    loader: Any, declared: str, shown: list[str], tmp_path: Path
) -> None:
    """A client learns what a create may give from the metadata; before, only a create's 400 told it."""
    path = tmp_path / "declaring_pipeline.py"
    path.write_text(DECLARING_PIPELINE.replace("{declared}", declared))
    worker_mode = "process" if loader is start_process_service else "in-process"
    async with serve(settings(pipeline=str(path), worker_mode=worker_mode), loader) as s:
        status, metadata = await s.json("get", "/v1/service/metadata")
        assert status == 200 and metadata["session_inputs"] == shown, metadata.get("session_inputs")
        status, refused = await s.json("post", "/v1/stream/sessions", json={"identity": "ctl", "prompt": "a street"})
        assert (status == 400) == ("prompt" not in shown), refused  # what it says is what a create meets


async def test_a_server_push_replay_says_it_takes_no_session_input() -> None:
    async with running() as server:  # the replay stream (takes_prompt = takes_image = False), served for real
        status, metadata = await server.request("GET", "/v1/service/metadata")
    assert status == 200 and metadata["session_inputs"] == [], metadata.get("session_inputs")


async def test_session_inputs_are_null_until_a_worker_has_loaded_the_pipeline() -> None:
    loader = GatedLoader()
    async with serve_toy(loader=loader, ready=False) as served:
        await trio.to_thread.run_sync(loader.entered.wait)
        try:
            status, metadata, _ = await served.json("get", "/v1/service/metadata")
            assert status == 200 and "session_inputs" in metadata and metadata["session_inputs"] is None, metadata
        finally:
            loader.release()
        await wait_ready(served.runtime)
        status, metadata, _ = await served.json("get", "/v1/service/metadata")
        assert metadata["session_inputs"] == ["prompt", "image"]  # the toy world takes both


async def test_session_inputs_come_from_worker_agents_too(served: Any) -> None:
    """In-process, and with ``--workers local`` (an agent says what its pipeline takes in its Ready)."""
    status, metadata, _ = await served.json("get", "/v1/service/metadata")
    assert status == 200 and metadata["session_inputs"] == ["prompt", "image"], metadata.get("session_inputs")

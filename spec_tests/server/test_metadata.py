"""``GET /v1/service/metadata`` reports a setting only where it applies: ``control_idle_timeout`` (how long a
session may send no control before it steps aside) for a pipeline whose ``get_service`` takes it, ``null`` for a
server-push stream, which never gets one, and for a pipeline that takes controls but not that setting (it never
applies it) — the same in-process and with the pipeline in a worker process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipelines.loader import load_service
from server.process_service import start_process_service
from spec_tests.security.test_hostile_server import running

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

"""``GET /v1/service/metadata`` reports a setting only where it applies: ``control_idle_timeout`` (how long a
session may send no control before it steps aside) for a pipeline that takes controls, ``null`` for a server-push
stream, which never gets one."""

from __future__ import annotations

from typing import Any

import pytest

from spec_tests.security.test_hostile_server import running

from .runner_fixtures import CounterService, no_threads, serve, settings  # noqa: F401


async def test_a_server_push_pipeline_reports_no_control_idle_timeout() -> None:
    async with running(control_idle_timeout=7.0) as server:  # the replay stream, served for real
        status, metadata = await server.request("GET", "/v1/service/metadata")
    assert status == 200 and metadata["pipeline_kind"] == "server_push"
    assert metadata["control_idle_timeout"] is None


@pytest.mark.usefixtures("no_threads")
async def test_a_pipeline_that_takes_controls_reports_its_control_idle_timeout(autojump_clock: Any) -> None:
    async with serve(settings(control_idle_timeout=7.0), CounterService()) as s:
        status, metadata = await s.json("get", "/v1/service/metadata")
    assert status == 200 and metadata["pipeline_kind"] == "bidirectional"
    assert metadata["control_idle_timeout"] == 7.0

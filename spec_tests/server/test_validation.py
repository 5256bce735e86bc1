"""``--skip-validation``: the startup check runs by default and the flag skips it (HTTP API).

The check (``pipelines/validation.py``) takes one warm-up chunk from the loaded
service and checks it against the contract before the worker takes sessions; a
pipeline that fails it fails its worker at startup with the reason, instead of
failing the first user's session. These tests run on the real clock (the toy
world computes in threads), bounded by the fixtures' wall-clock deadlines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from pipelines.contract import BidirectionalService, Chunk, Control, SessionConfig

from .conftest import make_settings, serve, wait_worker_failed


class FirstChunkOutOfOrder(BidirectionalService):
    """A pipeline whose streams start at chunk 7: a contract break the check catches."""

    def __init__(self) -> None:
        self.sessions: list[str] = []
        self.closed: list[str] = []

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        self.sessions.append(f"s{len(self.sessions)}")
        return self.sessions[-1]

    async def push_control(self, session_id: str, control: Control) -> None:
        pass

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        yield Chunk(7, np.zeros((1, 8, 8, 3), np.uint8), 10.0)

    async def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)


async def test_the_startup_check_takes_a_warm_up_chunk_before_the_worker_takes_sessions():
    async with serve(make_settings(skip_validation=False)) as s:
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert metadata["startup_check"] == {"worker-0": {"status": "passed", "frames": [2, 32, 48, 3], "fps": 16.0}}
        status, body, _ = await s.create("ctl")
        assert status == 200, body  # and the check's own session left its slot free


async def test_skip_validation_skips_the_startup_check():
    async with serve(make_settings(skip_validation=True)) as s:
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert metadata["startup_check"] == {"worker-0": {"status": "skipped"}}


@pytest.mark.parametrize("skip", [False, True])
async def test_a_pipeline_that_breaks_the_contract_fails_its_worker_at_startup_unless_skipped(skip):
    services: list[FirstChunkOutOfOrder] = []

    def load(path: str, **_: Any) -> FirstChunkOutOfOrder:
        services.append(FirstChunkOutOfOrder())
        return services[-1]

    async with serve(make_settings(skip_validation=skip), loader=load, ready=skip) as s:
        if skip:
            assert (await s.json("get", "/v1/service/ready"))[0] == 200
            assert services[0].sessions == []  # nothing ran before the first user's session
            return
        await wait_worker_failed(s.runtime)
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        reason = metadata["worker_failures"]["worker-0"]
        assert "PipelineValidationError" in reason and "index 7, not 0" in reason, reason
        assert services[0].sessions == services[0].closed == ["s0"]  # the check closed what it opened
        assert (await s.json("get", "/v1/service/ready"))[0] == 503
        status, body, _ = await s.create("ctl")
        assert status == 503, body

"""The startup check of a loaded pipeline (``pipelines/validation.py``), on each kind of service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from pipelines.contract import BidirectionalService, Chunk, Control, ServerPushService, SessionConfig
from pipelines.replay import get_service as replay_service
from pipelines.validation import PipelineValidationError, validate_service


class Scripted(BidirectionalService):
    """Each session's stream is ``script()``: nothing, a hang, or an error."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.closed: list[str] = []

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        return "s0"

    async def push_control(self, session_id: str, control: Control) -> None:
        pass

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        async for chunk in self.script():
            yield chunk

    async def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)


async def nothing() -> AsyncIterator[Chunk]:
    return
    yield


async def silence() -> AsyncIterator[Chunk]:
    await trio.sleep_forever()
    yield


async def explode() -> AsyncIterator[Chunk]:
    raise RuntimeError("the decoder is missing its weights")
    yield


async def test_a_server_push_service_passes_with_its_first_chunk():
    service = replay_service()
    assert isinstance(service, ServerPushService)
    async with service.running():
        chunk = await validate_service(service, timeout=30)
    assert chunk.index == 0 and chunk.frame_count > 0


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        (nothing, "the warm-up stream ended without a chunk"),
        (silence, "no warm-up chunk within 120 s"),
        (explode, "the warm-up chunk failed: RuntimeError: the decoder is missing its weights"),
    ],
)
async def test_a_service_without_a_good_first_chunk_fails_the_check_and_its_session_is_closed(
    script, reason, autojump_clock
):
    service = Scripted(script)
    with pytest.raises(PipelineValidationError, match=reason):
        await validate_service(service, timeout=120)
    assert service.closed == ["s0"]


async def test_something_that_is_no_service_fails_the_check():
    with pytest.raises(PipelineValidationError, match="get_service returned object"):
        await validate_service(object(), timeout=1)

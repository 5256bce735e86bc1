"""The startup check of a loaded pipeline (``pipelines/validation.py``), on each kind of service."""

from __future__ import annotations

from typing import Any

import pytest

from pipelines.contract import ServerPushService
from pipelines.replay import get_service as replay_service
from pipelines.validation import PipelineValidationError, validate_service

from .minimal_service import MinimalService


async def test_a_server_push_service_passes_with_its_first_chunk():
    service = replay_service()
    assert isinstance(service, ServerPushService)
    async with service.running():
        chunk = await validate_service(service, timeout=30)
    assert chunk.index == 0 and chunk.frame_count > 0


@pytest.mark.parametrize(
    ("then", "reason"),
    [
        ("end", "the warm-up stream ended without a chunk"),
        ("hang", "no warm-up chunk within 120 s"),
        (RuntimeError("the decoder is missing its weights"),
         "the warm-up chunk failed: RuntimeError: the decoder is missing its weights"),
    ],
    ids=["nothing", "silence", "explode"],
)
async def test_a_service_without_a_good_first_chunk_fails_the_check_and_its_session_is_closed(
    then: Any, reason: str, autojump_clock: Any
) -> None:
    service = MinimalService(chunks=0, then=then)
    with pytest.raises(PipelineValidationError, match=reason):
        await validate_service(service, timeout=120)
    assert service.closed == ["s0"]


async def test_something_that_is_no_service_fails_the_check():
    with pytest.raises(PipelineValidationError, match="get_service returned object"):
        await validate_service(object(), timeout=1)

"""The startup check of a loaded pipeline: one warm-up chunk through the service contract.

A model worker runs it once the service is up and before it takes sessions
(``--skip-validation`` skips it), so a pipeline that cannot produce a chunk, or
produces one that breaks the contract, fails its worker with a reason at
startup instead of failing the first user's session. The check opens one
session (a bidirectional service) or one stream (a server-push service) with
the default :class:`~pipelines.contract.SessionConfig`, takes its first chunk,
checks it and closes what it opened.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio

from .contract import (
    BidirectionalService, Chunk, PipelineContractError, ServerPushService, SessionConfig, checked_session_id, checked_stream)

__all__ = ["PipelineValidationError", "validate_service"]


class PipelineValidationError(RuntimeError):
    """The pipeline failed its startup check; the message says what was wrong."""


async def validate_service(service: object, *, timeout: float) -> Chunk:
    """Take one warm-up chunk from ``service`` within ``timeout`` seconds and check it; return it."""
    if not isinstance(service, BidirectionalService | ServerPushService):
        raise PipelineValidationError(
            f"get_service returned {type(service).__name__}, not a BidirectionalService or ServerPushService"
        )
    chunk: object = None
    try:
        with trio.move_on_after(timeout) as deadline:
            if isinstance(service, BidirectionalService):
                chunk = await _first_session_chunk(service)
            else:
                chunk = await _first_chunk(checked_stream(service.stream(SessionConfig()), "stream()"))
    except PipelineValidationError:
        raise
    except Exception as exc:
        # a server-push stream refuses its options as it starts: say which the check gave (none)
        plain = isinstance(service, BidirectionalService) or isinstance(exc, PipelineContractError)
        of = "" if plain else f" (a stream of {DEFAULT_CONFIG})"
        raise PipelineValidationError(f"the warm-up chunk failed{of}: {type(exc).__name__}: {exc}") from exc
    if deadline.cancelled_caught:
        raise PipelineValidationError(f"no warm-up chunk within {timeout:g} s")
    return check_first_chunk(chunk)


def check_first_chunk(chunk: object) -> Chunk:
    """The contract of a stream's first chunk (a Chunk validates its frames and fps itself)."""
    if not isinstance(chunk, Chunk):
        raise PipelineValidationError(f"the warm-up chunk is a {type(chunk).__name__}, not a Chunk")
    if chunk.index != 0:
        raise PipelineValidationError(f"the first chunk of a stream has index {chunk.index}, not 0")
    return chunk


#: what the check's session or stream is made from, as its failure says (a create needing an option failed the check
#: as "the warm-up chunk failed: ValueError: ...", the author left to guess which session it meant)
DEFAULT_CONFIG = "the default SessionConfig: no prompt, no image, no options"


async def _first_session_chunk(service: BidirectionalService) -> object:
    try:
        session_id = await service.create_session(SessionConfig())
    except Exception as exc:
        raise PipelineValidationError(
            f"create_session for the warm-up session ({DEFAULT_CONFIG}) failed: {type(exc).__name__}: {exc}; make "
            f"it take that, or serve with --skip-validation"
        ) from exc
    try:
        chunk = await _first_chunk(checked_stream(service.chunks(checked_session_id(session_id)), "chunks()"))
    except BaseException:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            with contextlib.suppress(Exception):  # the chunk's failure is the one to tell
                await service.close_session(session_id)
        raise
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT) as closing:
        try:
            await service.close_session(session_id)
        except Exception as exc:  # the chunk was fine: say that the close (a teardown hook) failed
            raise PipelineValidationError(
                f"closing the warm-up session failed: {type(exc).__name__}: {exc}"
            ) from exc
    if closing.cancelled_caught:
        raise PipelineValidationError(f"closing the warm-up session took longer than {CLOSE_TIMEOUT:g} s")
    return chunk


#: Seconds the check waits for its own session to close (its deadline may have passed).
CLOSE_TIMEOUT = 30.0


async def _first_chunk(chunks: AsyncIterator[object]) -> object:
    async with contextlib.aclosing(chunks) as stream:  # type: ignore[type-var]
        async for chunk in stream:
            return chunk
    raise PipelineValidationError("the warm-up stream ended without a chunk")

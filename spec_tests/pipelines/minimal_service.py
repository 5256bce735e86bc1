"""A small, correct BidirectionalService for the contract tests (validation, an author's mistakes); each
test changes one thing of it.

Its stream is one async generator, not one wrapping another: a run that abandons a bad stream leaves
no inner generator unfinalized behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import numpy as np
import trio

from pipelines.contract import BidirectionalService, Chunk, Control, SessionConfig


class MinimalService(BidirectionalService):
    """One session ``s0`` whose stream is ``chunks`` chunks of black frames, then ``then``: the stream
    ends, hangs, or raises that exception. ``dict_chunks`` yields plain dicts instead of ``Chunk``s;
    ``close_fails`` makes ``close_session`` raise. Closed sessions are recorded in ``closed``."""

    def __init__(
        self,
        *,
        chunks: int = 100,
        then: Literal["end", "hang"] | Exception = "end",
        dict_chunks: bool = False,
        close_fails: bool = False,
    ) -> None:
        self.chunk_count = chunks
        self.then = then
        self.dict_chunks = dict_chunks
        self.close_fails = close_fails
        self.closed: list[str] = []

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def create_session(self, config: SessionConfig, *, on_event: Any = None) -> str:
        return "s0"

    async def push_control(self, session_id: str, control: Control) -> None:
        pass

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        for index in range(self.chunk_count):
            frames = np.zeros((2, 8, 8, 3), np.uint8)
            yield {"frames": frames} if self.dict_chunks else Chunk(index, frames, 8.0)  # type: ignore[misc]
        if self.then == "hang":
            await trio.sleep_forever()
        elif isinstance(self.then, Exception):
            raise self.then

    async def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)
        if self.close_fails:
            raise RuntimeError("teardown failed")

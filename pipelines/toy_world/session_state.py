"""What the toy world service keeps per session (in the trio thread): controls, cursors, channels."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import trio

from ..contract import Control, EventSink, SessionConfig
from ..prefetch import ConditionPrefetch

__all__ = ["ToySession"]


@attrs.define
class ToySession:
    """One session's routing state; its model state lives in the denoise owner's slot."""

    session_id: str
    slot: int
    orch: Any  # engine.Session
    prefetch: ConditionPrefetch
    config: SessionConfig
    image: np.ndarray | None
    continuous: bool
    chunk_count: int | None
    on_event: EventSink | None
    send_chunk: trio.MemorySendChannel
    receive_chunk: trio.MemoryReceiveChannel
    prompt: str | None = None
    resolution: tuple[int, int] | None = None  # (height, width); None: the service's default
    world_sent: bool = False
    held: set[str] = attrs.Factory(set)
    pressed: set[str] = attrs.Factory(set)  # short presses not yet seen by a chunk
    reset_pose_pending: bool = False
    new_prompt_pending: bool = False
    timeline: list[tuple[float, Control]] = attrs.Factory(list)
    stopping: bool = False
    submitted: int = 0  # chunks whose control was admitted
    delivered: int = 0  # chunks handed to the consumer
    forwarded: int = -1  # highest chunk index the reader passed on
    last_index: int | None = None  # set when no more chunks will be requested
    denoised: dict[int, trio.Event] = attrs.Factory(dict)
    changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    finished: trio.Event = attrs.Factory(trio.Event)
    error: BaseException | None = None  # why the pipeline session failed

    def wake(self) -> None:
        self.changed.unpark_all()

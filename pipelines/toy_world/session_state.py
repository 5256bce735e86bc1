"""What a toy world session asks for (its options) and what the service keeps per session (in the trio thread):
controls, cursors, channels."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import trio

from engine import MAX_SEQUENCE_ID

from pipelines.contract import Control, EventSink, SessionConfig
from pipelines.json_objects import as_json
from pipelines.prefetch import ConditionPrefetch
from .model import ToyWorldConfig, parse_resolution

__all__ = ["MAX_CHUNKS", "SESSION_OPTIONS", "ToySession", "check_image_size", "session_options"]

#: the options a session may ask for (``SessionConfig.options``); anything else is refused naming it.
SESSION_OPTIONS = frozenset({"continuous", "chunks", "resolution"})
MAX_CHUNKS = MAX_SEQUENCE_ID + 1  # chunk k is the engine's sequence k


def session_options(options: Mapping[str, Any], config: ToyWorldConfig) -> tuple[bool, int | None, Any]:
    """``(continuous, chunks, resolution)`` from a session's options, or a ``ValueError`` naming the bad one."""
    unknown = sorted(str(name) for name in options if name not in SESSION_OPTIONS)
    if unknown:  # a misspelt option would otherwise stream the default world without a word
        raise ValueError(f"toy world: unknown option(s) {unknown} (known: {sorted(SESSION_OPTIONS)})")
    continuous = options.get("continuous", False)
    if not isinstance(continuous, bool):
        raise ValueError(f"option 'continuous' must be true or false, got {as_json(continuous)}")
    chunk_count = options.get("chunks")
    if "chunks" in options and (isinstance(chunk_count, bool) or not isinstance(chunk_count, int)
                                or not 1 <= chunk_count <= MAX_CHUNKS):
        # leave it out for a session without end; at most one chunk per sequence id the engine has
        raise ValueError(f"option 'chunks' must be an int in 1..2**63, got {as_json(chunk_count)}")
    resolution = options.get("resolution")
    if resolution is not None:
        resolution = parse_resolution(resolution, config)  # ValueError naming 'resolution'
    return continuous, chunk_count, resolution


def check_image_size(width: int, height: int, config: ToyWorldConfig, *, name: str = "the image") -> None:
    """A ``ValueError`` naming the size of an image under 2 x 2 pixels as it is read (at most ``config.world_size``):
    the encode stage's minimum, which failed the session once it began. The one check of ``create_session`` (on the
    image it read) and ``check_image`` (on the size a create's header gives, before anything is held)."""
    most_height, most_width = config.world_size
    if min(width, most_width) < 2 or min(height, most_height) < 2:
        raise ValueError(f"{name} is {width} x {height} pixels; the toy world takes one of at least 2 x 2")


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

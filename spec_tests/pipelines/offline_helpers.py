"""What the offline-run tests share (``test_offline_run.py``, ``test_chunkline_run.py``).

``CounterWorld``, a small real world whose held keys integrate into a counter drawn into every frame; the timed
controls the runs play (``TIMED``) with the counters they lead to; the keys ``metrics.json`` holds; and readers of
a run's output folder.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import av
import numpy as np
import trio

from pipelines.contract import (
    BidirectionalService,
    Chunk,
    Control,
    ControlRejected,
    ControlType,
    EventSink,
    ServiceEvent,
    SessionConfig,
)
from server.run_command import run_deadlines

#: the deadlines ``chunkline run`` gives a run (the server's own)
DEADLINES = run_deadlines()

METRIC_KEYS = {
    "kind",
    "requested_chunks",
    "chunks",
    "frames",
    "fps",
    "width",
    "height",
    "chunk_media_seconds",
    "media_seconds",
    "wall_seconds",
    "ended_early",
    "session_setup_seconds",
    "first_output_latency_seconds",
    "chunk_period",
    "real_time_factor",
    "control_to_output_latency",
    "controls",
    "stage_times",
    "idle_reasons",
    "events",
    "audio",
}
SUMMARY_KEYS = {"count", "minimum_seconds", "p50_seconds", "p95_seconds", "maximum_seconds", "mean_seconds"}


# --- a small real world: held keys integrate into a counter drawn into every frame ------------------------


@attrs.define
class _Session:
    held: set[str] = attrs.Factory(set)
    pending: list[Control] = attrs.Factory(list)
    counter: int = 0
    started: int = 0  # chunks started so far
    prompt: str | None = None
    closed: bool = False


class CounterWorld(BidirectionalService):
    """Per chunk: apply the pushed controls, then counter += (w held) - (s held); frames show 100 + 20 * counter.

    ``reset`` releases every key, ``reset_pose`` sets the counter back to 0, a prompt containing "forbidden"
    is rejected. ``fail_at`` raises while making that chunk; ``hang_at`` never finishes it.
    """

    FPS = 8.0
    FRAMES = 4  # 0.5 s of media a chunk
    HEIGHT, WIDTH = 16, 32

    def __init__(self, fail_at: int | None = None, hang_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.hang_at = hang_at
        self.sessions: dict[str, _Session] = {}
        self.pushes: list[tuple[str, int]] = []  # (control type, chunks started when it was pushed)
        self.closed_sessions: list[str] = []
        self.is_running = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[CounterWorld]:
        self.is_running = True
        try:
            yield self
        finally:
            self.is_running = False

    async def create_session(self, config: SessionConfig, *, on_event: EventSink | None = None) -> str:
        assert self.is_running
        session_id = f"s{len(self.sessions)}"
        self.sessions[session_id] = _Session(prompt=config.prompt)
        if on_event is not None:
            on_event(ServiceEvent(session_id, "session_ready"))
        return session_id

    async def push_control(self, session_id: str, control: Control) -> None:
        session = self.sessions[session_id]
        if control.type is ControlType.PROMPT and "forbidden" in (control.prompt or ""):
            raise ControlRejected("prompt refused")
        session.pending.append(control)
        self.pushes.append((control.type.value, session.started))

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        session = self.sessions[session_id]
        index = 0
        while not session.closed:
            session.started += 1
            for control in session.pending:
                if control.type is ControlType.CONTROL:
                    (session.held.add if control.pressed else session.held.discard)(control.key)
                elif control.type is ControlType.CONTROL_STATE:
                    session.held = set(control.keys)
                elif control.type is ControlType.RESET:
                    session.held.clear()
                elif control.type is ControlType.RESET_POSE:
                    session.counter = 0
                elif control.type is ControlType.PROMPT:
                    session.prompt = control.prompt
            session.pending.clear()
            session.counter += ("w" in session.held) - ("s" in session.held)
            if index == self.fail_at:
                raise RuntimeError("the world fell over")
            if index == self.hang_at:
                await trio.sleep_forever()
            value = int(np.clip(100 + 20 * session.counter, 0, 255))
            yield Chunk(
                index=index,
                frames=np.full((self.FRAMES, self.HEIGHT, self.WIDTH, 3), value, dtype=np.uint8),
                fps=self.FPS,
                applied_controls={"keys": sorted(session.held), "counter": session.counter},
                metadata={"stage_times": {"step": 0.002, "draw": {"seconds": 0.001}}, "idle_reasons": ["continuous"]},
            )
            index += 1
            await trio.lowlevel.checkpoint()

    async def close_session(self, session_id: str) -> None:
        self.sessions[session_id].closed = True
        self.closed_sessions.append(session_id)


def get_service(gpu_num: int = 0) -> CounterWorld:  # lets the test's pipeline files load it
    return CounterWorld()


def decoded_video(path: Path) -> tuple[list[np.ndarray], list[str]]:
    with av.open(str(path)) as container:
        kinds = [s.type for s in container.streams]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return frames, kinds


def files_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


# --- the timed controls the runs play ----------------------------------------------------------------------

TIMED = [
    {"t": 0, "type": "control", "control": "ArrowUp", "event": "press"},  # chunk 0 (starts at 0.0)
    {"t": 0.7, "type": "control", "control": "KeyW", "event": "release"},  # chunk 2 (1.0), not chunk 1 (0.5)
    {"t": 1.5, "type": "control_state", "controls": ["backward"]},  # chunk 3, starting exactly at 1.5
    {"t": 1.6, "type": "prompt", "prompt": "a snowy street"},  # chunk 4
    {"t": 1.7, "type": "prompt", "prompt": "forbidden words"},  # chunk 4, rejected by the service
    {"t": 2.5, "type": "reset"},  # chunk 5
    {"t": 2.9, "type": "control", "control": "forward", "event": "press"},  # chunk 6
    {"t": 3.5, "type": "reset_pose"},  # chunk 7
    {"t": 99, "type": "reset"},  # after the last chunk: never pushed
]
# counter after each chunk: +1, +1, 0 (released), -1 (s held), -1, 0 (reset), +1, reset to 0 then +1
EXPECTED_COUNTERS = [1, 2, 2, 1, 0, 0, 1, 1]

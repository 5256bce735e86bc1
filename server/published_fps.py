"""Published frames per second over a trailing window, in aggregate and per session.

The figures behind ``chunkline_published_fps{scope}`` (reference B.12, F.17), over the
trailing window ``(now - window_seconds, now]``:

* ``aggregate`` — every frame published in the window (sessions that have since finished
  included) divided by the window length;
* ``per_session_mean|p50|p95|min`` — over the live sessions that published at least one frame
  in the window, each session's frames in the window divided by the window length.
  Quantiles are nearest-rank: the value at rank ``ceil(q * n)`` of the ascending sample
  (never interpolated, unlike the orchestrator's linear percentiles in ``engine.metrics``).
  With no such session every per-session scope reads 0.

Dividing by the full window keeps the figures comparable, at the price that a session
younger than the window reads low until it has published for a whole window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

__all__ = ["FPS_SCOPES", "FrameWindow", "PublishedFps", "nearest_rank"]

FPS_SCOPES = (
    "aggregate",
    "per_session_mean",
    "per_session_p50",
    "per_session_p95",
    "per_session_min",
)


def nearest_rank(ordered: Sequence[float], fraction: float) -> float:
    """The nearest-rank quantile of an ascending sample: the element at rank ceil(q * n)."""
    if not ordered:
        raise ValueError("quantile of an empty sample")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"quantile fraction {fraction!r} is outside [0, 1]")
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


class FrameWindow:
    """(time, frames) entries inside a trailing window; older entries are pruned lazily."""

    __slots__ = ("_entries", "_frames")

    def __init__(self) -> None:
        self._entries: deque[tuple[float, int]] = deque()
        self._frames = 0

    def add(self, at: float, frames: int) -> None:
        # Entries normally arrive in time order; an out-of-order stamp is kept sorted so
        # pruning from the left stays correct.
        if self._entries and at < self._entries[-1][0]:
            entries = sorted([*self._entries, (at, frames)], key=lambda entry: entry[0])
            self._entries = deque(entries)
        else:
            self._entries.append((at, frames))
        self._frames += frames

    def frames_since(self, horizon: float) -> int:
        """Drop entries at or before `horizon`; return the frames that remain."""
        while self._entries and self._entries[0][0] <= horizon:
            _, frames = self._entries.popleft()
            self._frames -= frames
        return self._frames


class PublishedFps:
    """The aggregate window and one window per session; bounded by pruning on every add."""

    def __init__(self, window_seconds: float) -> None:
        if not window_seconds > 0:
            raise ValueError(f"fps_window_seconds must be > 0, got {window_seconds!r}")
        self.window_seconds = float(window_seconds)
        self._aggregate = FrameWindow()
        self._sessions: dict[str, FrameWindow] = {}

    def add(self, session_key: str, at: float, frames: int, now: float) -> None:
        """``frames`` frames of a session published at ``at``; entries older than the window go."""
        horizon = now - self.window_seconds
        self._aggregate.add(at, frames)
        self._aggregate.frames_since(horizon)
        window = self._sessions.get(session_key)
        if window is None:
            window = self._sessions[session_key] = FrameWindow()
        window.add(at, frames)
        window.frames_since(horizon)

    def forget(self, session_key: str) -> None:
        """The session finished: it no longer counts in the per-session scopes."""
        self._sessions.pop(session_key, None)

    def rates(self, now: float) -> dict[str, float]:
        """Every scope of :data:`FPS_SCOPES` over the window ending at ``now``."""
        horizon = now - self.window_seconds
        window = self.window_seconds
        aggregate = self._aggregate.frames_since(horizon) / window
        in_window = {key: w.frames_since(horizon) for key, w in self._sessions.items()}
        for key, frames in in_window.items():
            if frames == 0:  # idle for a whole window: no longer an active session
                del self._sessions[key]
        rates = sorted(frames / window for frames in in_window.values() if frames > 0)
        if rates:
            per_session = {
                "per_session_mean": math.fsum(rates) / len(rates),
                "per_session_p50": nearest_rank(rates, 0.50),
                "per_session_p95": nearest_rank(rates, 0.95),
                "per_session_min": rates[0],
            }
        else:
            per_session = dict.fromkeys(FPS_SCOPES[1:], 0.0)
        return {"aggregate": aggregate, **per_session}

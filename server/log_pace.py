"""Warnings that anyone who can open a connection can cause, logged at a bounded pace.

A peer that does not hold the cluster token can still make the authority fail a handshake or refuse a
register, as often as it can open connections (thousands a second); one log line each let it fill the
disk. :class:`LogPace` logs such lines as they come up to a burst, then at most one a second, each
saying how many like it were left out since the last one logged.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

__all__ = ["LogPace", "LOG_BURST", "LOG_LINES_PER_SECOND"]

LOG_BURST = 20  # lines of one kind logged back to back before the pace holds
LOG_LINES_PER_SECOND = 1.0


class LogPace:
    """One kind of warning, logged through a token bucket (trio's clock), with a count of what was left out."""

    def __init__(self, logger: logging.Logger, *, burst: int = LOG_BURST, per_second: float = LOG_LINES_PER_SECOND) -> None:
        self._logger = logger
        self._burst = burst
        self._per_second = per_second
        self._tokens = float(burst)
        self._at: float | None = None
        self.left_out = 0  # lines of this kind not logged since the last one that was

    def warning(self, message: str, *args: Any) -> None:
        now = trio.current_time()
        if self._at is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._per_second)
        self._at = now
        if self._tokens < 1:
            self.left_out += 1
            return
        self._tokens -= 1
        if self.left_out:
            message += f" ({self.left_out} more like it were not logged)"
            self.left_out = 0
        self._logger.warning(message, *args)

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

from .token_bucket import TokenBucket

__all__ = ["LogPace", "LOG_BURST", "LOG_LINES_PER_SECOND", "WORKER_LINES_BURST", "WORKER_LINES_PER_SECOND"]

LOG_BURST = 20  # lines of one kind logged back to back before the pace holds
LOG_LINES_PER_SECOND = 1.0
#: the lines of a worker's comings and goings (registered, ready, lost, left): a cluster of a hundred agents starting
#: at once logs each, but an agent holding the cluster token that registered and left in a loop (111 times a second)
#: wrote three lines each time
WORKER_LINES_BURST = 200
WORKER_LINES_PER_SECOND = 2.0


class LogPace:
    """One kind of warning, logged through a token bucket (trio's clock), with a count of what was left out."""

    def __init__(self, logger: logging.Logger, *, burst: int = LOG_BURST, per_second: float = LOG_LINES_PER_SECOND) -> None:
        self._logger = logger
        self._bucket = TokenBucket(per_second, burst)
        self.left_out = 0  # lines of this kind not logged since the last one that was

    def info(self, message: str, *args: Any) -> None:
        self.log(logging.INFO, message, *args)

    def warning(self, message: str, *args: Any) -> None:
        self.log(logging.WARNING, message, *args)

    def error(self, message: str, *args: Any) -> None:
        """An error line with the traceback of the exception being handled."""
        self.log(logging.ERROR, message, *args, exc_info=True)

    def log(self, level: int, message: str, *args: Any, exc_info: bool = False) -> None:
        if self._bucket.wait(trio.current_time()) > 0:
            self.left_out += 1
            return
        if self.left_out:
            message += f" ({self.left_out} more like it were not logged)"
            self.left_out = 0
        self._logger.log(level, message, *args, exc_info=exc_info)

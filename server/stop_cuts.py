"""Waits a stop cuts short: what a request still waits for when the server begins to stop is given up at once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

__all__ = ["CutOnStop"]


class CutOnStop:
    """Blocks of work (a create's image decode and options' check) that the stop cancels: the request is then
    answered as any during the stop is (a create's check could outlast the front's grace for answers, and its
    client be cut off unanswered)."""

    def __init__(self) -> None:
        self._scopes: set[trio.CancelScope] = set()
        self._cut = False

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The block runs until it ends, or until :meth:`cut` (at once, if that came already)."""
        scope = trio.CancelScope()
        if self._cut:
            scope.cancel(reason="the server is shutting down")
        self._scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._scopes.discard(scope)

    def cut(self) -> None:
        """The stop begins: every block under way, and any begun from now on, ends."""
        self._cut = True
        for scope in self._scopes:
            scope.cancel(reason="the server is shutting down")

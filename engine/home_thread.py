"""The thread an orchestrator's trio run is in: its sessions are driven from there only.

The scheduler's trio side (queues, events, cancel scopes, the pipeline-session table) is not thread-safe. A
session called from another thread (a plain thread, a stage's handler, a second ``trio.run``) corrupted it
silently, hung, or ended in a ``TrioInternalError``; each such call is now refused before it runs. The check is
one thread-id comparison.
"""

from __future__ import annotations

import threading

from .errors import WrongThreadError

__all__ = ["HomeThread"]


class HomeThread:
    """The thread that made it (an orchestrator's, inside its trio run); ``check`` refuses calls from any other."""

    __slots__ = ("ident", "name")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.name = threading.current_thread().name

    def check(self, owner: str, call: str) -> None:
        if threading.get_ident() != self.ident:
            raise WrongThreadError(
                f"{owner} belongs to the trio run in thread {self.name!r}; {call}() was called from thread "
                f"{threading.current_thread().name!r}. It is not thread-safe: call it from that run "
                f"(from another thread: trio.from_thread.run with that run's trio token)"
            )

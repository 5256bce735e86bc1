"""How much Python a scheduler runs per chunk: bytecodes executed, counted on every thread.

Wall time and CPU time on a shared, virtualised host move by 20-50 % from one run to the
next; the number of bytecodes a chunk costs hardly moves (about 1-2 %, from how often a
push finds its edge full). On w1, where handlers cost nothing and the GIL serialises the
threads, it is the scheduler's own work per chunk, so two schedulers (or two versions of
one) compare by it without the host's noise. Counting traces every bytecode (tens of times
slower), so it runs on a short w1 of its own after the timed runs.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["bytecodes_per_chunk", "COUNTED_CHUNKS"]

COUNTED_CHUNKS = 300  # enough for a steady state; the count is per chunk


def bytecodes_per_chunk(run: Callable[[], Any], chunks: int, thread_names: frozenset[str] = frozenset()) -> dict[str, float]:
    """Bytecodes executed per chunk while ``run()`` runs, by thread: ``main``, each named thread, ``other``."""
    counts: Counter[str] = Counter()

    def by_thread() -> str:
        thread = threading.current_thread()
        if thread is threading.main_thread():
            return "main"
        return thread.name if thread.name in thread_names else "other"

    def count(frame: FrameType, event: str, arg: object) -> Callable | None:
        if event == "opcode":
            counts[by_thread()] += 1
        return count

    def enter(frame: FrameType, event: str, arg: object) -> Callable | None:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return count

    threading.settrace(enter)
    sys.settrace(enter)
    try:
        run()
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    figures = {name: total / chunks for name, total in sorted(counts.items())}
    figures["total"] = sum(counts.values()) / chunks
    return figures

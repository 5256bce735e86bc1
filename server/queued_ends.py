"""Ending many queued sessions at once — the shutdown, every worker gone, a burst of expiries — a batch at a time.

Ending a queued session is a few lookups (its table event, its queue place, its room); ending 10,000 of them in
one loop still held the event loop for as long as all of them took, and health checks, other requests and live
sessions waited. A pass here ends :data:`BATCH` sessions, then lets every other task run, then goes on. So that
the sessions it was asked to end end as they were told (and not some promoted onto a free slot between two
batches), the admission book holds its promotions for the whole pass; passes run one after another, in the
order they were asked for (the shutdown's waits for an earlier pass to finish, whose sessions keep its cause).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from states.admission import AdmissionBook, Transition
from states.stream_session import IN_QUEUE, DrainCause

from .registry import SessionRecord

__all__ = ["BATCH", "QueuedEnds"]

#: queued sessions ended before other tasks run again (some 5 ms of the event loop)
BATCH = 200


class QueuedEnds:
    """Runs passes over queued sessions for the runtime, which says how one ends, how the book's answer is
    followed and how the gauges are published."""

    def __init__(
        self,
        book: AdmissionBook,
        *,
        end_one: Callable[[SessionRecord, DrainCause, str | None], None],
        follow: Callable[[list[Transition]], None],
        publish: Callable[[], None],
    ) -> None:
        self._book = book
        self._end_one = end_one
        self._follow = follow
        self._publish = publish  # the gauges, once a batch (once a session, they were most of a pass's time)
        self._turn = trio.Lock()  # one pass at a time, first asked first served

    async def end(self, records: Sequence[SessionRecord], cause: DrainCause, reason: str | None) -> None:
        """End each of ``records`` still queued when the pass reaches it, with ``cause`` (and ``reason``, the error
        of a session the table fails for the cause); a checkpoint after every :data:`BATCH`."""
        async with self._turn:
            self._book.hold_promotions()
            try:
                for start in range(0, len(records), BATCH):
                    if start:
                        await trio.lowlevel.checkpoint()  # the others run: requests, health, live sessions
                    for record in records[start : start + BATCH]:
                        if record.status in IN_QUEUE:  # one a client deleted meanwhile has ended already
                            self._end_one(record, cause, reason)
                    self._publish()
            finally:
                self._follow(self._book.resume_promotions(trio.current_time()))

"""The one owner of every stream-session record transition in the server.

The runtime (admission, DELETE, the sweep) and the room runners (progress,
timeouts, the end) never move a record themselves: they ask
:class:`SessionLifecycle`, which applies the event through the registry (and so
through the stream-session table) and records what goes with it (the worker,
the drain cause, the error). A drain's cause is recorded with its DRAIN, once:
the first cause wins; a queued session, which never drains, keeps the cause it ended
with. A drain's outcome is the table's
(:func:`states.stream_session.settle_event`), never a string compared later.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import trio

from states.stream_session import (
    DRAINED, FAILING_CAUSES, QUEUED_ENDS_WITH, RUNNER_PROGRESS, DrainCause, Event, settle_event,
)

from . import protocol
from .registry import SessionRecord, SessionRegistry

__all__ = ["SessionLifecycle", "runner_last_word", "shutdown_outcome"]


class SessionLifecycle:
    """Moves stream-session records; single owner: the runtime's trio thread."""

    def __init__(self, registry: SessionRegistry, on_moved: Callable[[], None] = lambda: None) -> None:
        self.registry = registry
        #: told after every move (the sessions-by-status gauge: it followed the moves only at the next sweep)
        self.on_moved = on_moved
        #: told of each record that has just become terminal (the app closes its room), with the room's last
        #: ``tf.status`` message when the server may have to say it (else None), and whether the session's worker
        #: says it told the room itself
        self.on_terminal: Callable[[SessionRecord, bytes | None, bool], None] = lambda record, last_word, told: None

    def _apply(self, record: SessionRecord, event: Event, *, error: str | None = None, say_last_word: bool = False,
               cause_failed: bool = False, worker_told: bool = False) -> None:
        """``cause_failed``: the drain cause is what failed the session (the table's event for it is FAIL), which
        the last word then names."""
        self.registry.apply(record, event, now=trio.current_time(), error=error)
        self.on_moved()
        if record.is_terminal:
            word = last_word(record, record.error, 0, 0, cause_failed=cause_failed) if say_last_word else None
            self.on_terminal(record, word, worker_told)

    # -- admission ---------------------------------------------------------------------

    def reject(self, record: SessionRecord, reason: str) -> None:
        self._apply(record, Event.REJECT, error=reason)

    def queue(self, record: SessionRecord) -> None:
        self._apply(record, Event.QUEUE)

    def assign(self, record: SessionRecord, worker_id: str) -> None:
        record.worker_id = worker_id
        self._apply(record, Event.ASSIGN)

    def requeue(self, record: SessionRecord) -> None:
        """Its worker refused it before it ran, as the worker's state (it drains or failed): queued again."""
        record.worker_id = None
        self._apply(record, Event.REQUEUE)

    def end_queued(self, record: SessionRecord, cause: DrainCause, error: str | None = None) -> None:
        """A queued session ends (DELETE, its timeout, the shutdown, no worker left): the table's event for
        ``cause``, which the record keeps as its drain cause, as a live session's drain does.

        No worker ever joined its room, so the server says the session's last word itself (``done`` with the
        cause, or ``error`` with the cause and the reason when the table fails the session).
        """
        event = QUEUED_ENDS_WITH[cause]
        record.drain_cause = cause
        self._apply(record, event, error=error, say_last_word=True, cause_failed=event is Event.FAIL)

    # -- the runner's progress ---------------------------------------------------------------

    def step(self, record: SessionRecord, event: Event) -> bool:
        """A runner's progress (the table's ``RUNNER_PROGRESS``); False, changing nothing, once it drains, and for
        any other event (a drain goes through :meth:`drain` with its cause, the end through :meth:`settle`)."""
        if event not in RUNNER_PROGRESS or record.drain_cause is not None or not record.machine.can(event):
            return False
        self._apply(record, event)
        return True

    def drain(self, record: SessionRecord, cause: DrainCause, detail: str | None = None) -> bool:
        """Start the drain with its cause; False (changing nothing) when a drain already started or it ended.

        ``detail`` is the reason in words, kept for the record's error should the cause fail the session.
        """
        if not record.machine.can(Event.DRAIN):
            return False
        record.drain_cause = cause  # before the event: whoever hears of the DRAIN (an agent's report) sees why
        record.drain_detail = detail
        self._apply(record, Event.DRAIN)
        return True

    def settle(self, record: SessionRecord, error: str | None, *, worker_told: bool = False) -> None:
        """End a live session: its outcome from the table, by its drain cause (FAIL when ``error``).

        The server tells the room how the session ended, unless ``worker_told``: the worker says it told the room
        itself (a transport that sees the room checks that; one that cannot takes its word).
        """
        if record.is_terminal:
            return
        if error is None and record.drain_cause is None:
            self.drain(record, DrainCause.COMPLETED)
        event = settle_event(record.drain_cause, failed=error is not None)
        if event is Event.FAIL and error is None:
            error = record.drain_detail or (record.drain_cause.value if record.drain_cause else "failed")
        self._apply(record, event, error=error, say_last_word=True, cause_failed=record.drain_cause in FAILING_CAUSES,
                    worker_told=worker_told)


def last_word(record: SessionRecord, failure: str | None, chunks: int, frames: int, *, cause_failed: bool) -> bytes:
    """How a session ended, as its room is told, by its runner or by the server where no worker can say it: ``done``
    with the drain cause and what was published (``chunks``, ``frames``), or, with ``failure``, ``error`` with the
    drain cause where that is what failed the session (``cause_failed``), else ``session_failed`` (a failure after a
    drain that was not one: the server's word gave the cause, ``deleted``, as the failure, where the runner's did not).
    """
    if failure is None:
        cause = None if record.drain_cause is None else record.drain_cause.value
        return protocol.done_message(record.session_id, chunks, frames, reason=cause)
    failed_by = record.drain_cause if cause_failed else None
    return protocol.error_message(record.session_id, "session_failed" if failed_by is None else failed_by.value, failure)


def runner_last_word(record: SessionRecord, failure: str | None, chunks: int, frames: int) -> bytes:
    """What a room runner tells its room as its session ends (:func:`last_word` for a live session's drain)."""
    return last_word(record, failure, chunks, frames, cause_failed=record.drain_cause in FAILING_CAUSES)


def shutdown_outcome(runners: Iterable[Any], aborted: Collection[Any]) -> str:
    """How the sessions live as a shutdown began ended, for its last log line, each counted once by its record's
    outcome: drained (its drain settled as a drain does), stopped at once past the grace (``aborted``), lost with its
    worker (the worker failed or was lost during the drain), or failed on its own. The lost ones were counted drained,
    as every session not stopped past the grace was."""
    drained = lost = failed = 0
    for runner in runners:
        if runner in aborted:
            continue
        if runner.record.status in DRAINED:
            drained += 1
        elif runner.worker.failure is not None:
            lost += 1
        else:
            failed += 1
    words = f"{drained} session(s) drained, {len(aborted)} stopped at once past the grace"
    words += f", {lost} lost with their worker" if lost else ""
    return words + (f", {failed} failed" if failed else "")

"""Stream-session records: what the API reports, changed only through the stream-session table.

A record's status is its :class:`states.stream_session.StreamSessionMachine`;
:meth:`SessionRegistry.apply` is the one way to move it. Terminal records are
kept for a bounded time and count so clients can read the outcome, then pruned.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from states import stream_session as table
from states.stream_session import DrainCause, Event, State, StreamSessionMachine

from .reasons import echo
from .viewer_seats import ViewerPasses

__all__ = ["SessionRecord", "SessionRegistry", "UnknownCursor", "UnknownStreamSession"]


class UnknownStreamSession(KeyError):
    """No record with this id (it never existed or was pruned)."""


class UnknownCursor(ValueError):
    """A session-list cursor that names no session of this server run (malformed, from another run, or past the
    newest)."""


@attrs.define(eq=False)
class SessionRecord:
    session_id: str
    room: str
    controller_identity: str
    config: dict[str, Any]
    prompt: str | None
    image_path: str | None
    created_at: float  # wall clock, for clients
    expires_at: float | None  # wall clock, for clients
    deadline: float | None  # trio clock: when the session expires
    machine: StreamSessionMachine = attrs.Factory(StreamSessionMachine)
    worker_id: str | None = None
    pipeline_session_id: str | None = None
    error: str | None = None
    updated_at: float = 0.0
    terminal_since: float | None = None  # trio clock
    participants: set[str] = attrs.Factory(set)  # identities present in the room (worker excluded)
    viewer_passes: ViewerPasses = attrs.Factory(ViewerPasses)  # viewer tokens handed out, not used yet (bounded)
    drain_cause: DrainCause | None = None  # why it drains: set once, with its DRAIN (server.lifecycle)
    drain_detail: str | None = None  # the cause in words (the error, should the cause fail the session)
    upload_path: str | None = None  # a server-owned copy of an uploaded image, deleted when terminal
    serial: int = 0  # its place in creation order (set by the registry): the session list's page cursor

    @property
    def status(self) -> State:
        return self.machine.state

    @property
    def is_terminal(self) -> bool:
        return self.machine.is_terminal

    @property
    def takes_viewers(self) -> bool:
        return self.machine.state in table.TAKES_VIEWERS

    @property
    def participant_count(self) -> int:
        return len(self.participants)

    def public(self, *, queue_position: int | None = None) -> dict[str, Any]:
        """The fields of ``GET /v1/stream/sessions/{id}``."""
        return {
            "session_id": self.session_id,
            "room": self.room,
            "status": self.status.value,
            "worker_id": self.worker_id,
            "pipeline_session_id": self.pipeline_session_id,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "expires_at": self.expires_at,
            "participant_count": self.participant_count,
            "queue_position": queue_position,
            "error": self.error,
            "drain_cause": None if self.drain_cause is None else self.drain_cause.value,
        }


class SessionRegistry:
    """All records of one server, by id; single owner: the runtime (trio thread).

    The records per status are counted as they move (:meth:`counts` is read after every create and every end
    for the gauges: counting them then cost a pass over every record each time).
    """

    def __init__(self, *, wall_clock: Callable[[], float] = time.time, retention_count: int | None = None) -> None:
        self._records: dict[str, SessionRecord] = {}
        #: the terminal records' ids, in the order they ended; past ``retention_count`` the oldest is forgotten as
        #: another ends (the once-a-second sweep let a burst of ends list more than the count meanwhile)
        self._terminal: dict[str, None] = {}
        self._retention_count = retention_count
        self._by_room: dict[str, SessionRecord] = {}
        self._by_status: dict[State, int] = dict.fromkeys(State, 0)
        self._wall = wall_clock
        self._serials = 0  # records ever added: each new one gets the next serial
        # a cursor names this run: a serial from before a restart would skip as many of the new run's sessions
        self._run = secrets.token_hex(4)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(list(self._records.values()))

    def add(self, record: SessionRecord) -> None:
        if record.session_id in self._records:
            raise ValueError(f"session {record.session_id!r} already exists")
        record.updated_at = self._wall()
        self._serials += 1
        record.serial = self._serials
        self._records[record.session_id] = record
        self._by_room[record.room] = record
        self._by_status[record.status] += 1

    def get(self, session_id: str) -> SessionRecord:
        try:
            return self._records[session_id]
        except KeyError:
            raise UnknownStreamSession(session_id) from None

    def find(self, session_id: str) -> SessionRecord | None:
        return self._records.get(session_id)

    def in_room(self, room: str) -> SessionRecord | None:
        """The record whose room this is (None once it is pruned, or for a room no session made)."""
        return self._by_room.get(room)

    def list(self, status: State | None = None) -> list[SessionRecord]:
        return [r for r in self._records.values() if status is None or r.status is status]

    def page(self, *, after: str | None, limit: int, status: State | None = None) -> tuple[list[SessionRecord], str | None]:
        """Up to ``limit`` records created after the cursor ``after`` (from the first when None), oldest first (of one
        status, if given), and the cursor of the page after, while more follow. Records are kept in creation order,
        so a page is one pass that stops at its end; a record pruned or created between two pages moves no other
        record across the cursor. Raises :class:`UnknownCursor` for one that names no session of this run (a cursor
        is a session's place: one a page did not give still names where to go on from)."""
        start = 0 if after is None else self._serial_of(after)
        page: list[SessionRecord] = []
        for record in self._records.values():
            if record.serial <= start or (status is not None and record.status is not status):
                continue
            if len(page) == limit:
                return page, f"{self._run}-{page[-1].serial}"
            page.append(record)
        return page, None

    def _serial_of(self, cursor: str) -> int:
        run, _, serial = cursor.partition("-")
        # a page's cursor names a session of this run by its serial, written as a page writes it (no leading zero)
        if not (len(run) == len(self._run) and serial.isascii() and serial.isdigit() and len(serial) <= 19
                and serial[0] != "0"):
            raise UnknownCursor(f"after must be a cursor (the 'next' of the page before), got {echo(cursor)}")
        if run != self._run:
            raise UnknownCursor("after is a cursor of another server run (they end with it); list from the first page")
        if int(serial) > self._serials:
            raise UnknownCursor(f"after names no session of this run ({echo(cursor)}); list from the first page")
        return int(serial)

    def counts(self) -> dict[str, int]:
        """Records per status (every status named, 0 where none is)."""
        return {state.value: count for state, count in self._by_status.items()}

    def apply(self, record: SessionRecord, event: Event, *, now: float, error: str | None = None) -> State:
        """Move a record through the stream-session table (raises IllegalTransition, changing nothing).

        Only :class:`server.lifecycle.SessionLifecycle` calls this.
        """
        before = record.status
        state = record.machine.apply(event)
        if self._records.get(record.session_id) is record:  # a record not (or no longer) here is counted nowhere
            self._by_status[before] -= 1
            self._by_status[state] += 1
        record.updated_at = self._wall()
        if error is not None and record.error is None:
            record.error = error
        if state in table.TERMINAL and record.terminal_since is None:
            record.terminal_since = now
            if self._records.get(record.session_id) is record:
                self._terminal[record.session_id] = None
                if self._retention_count is not None:
                    while len(self._terminal) > self._retention_count:
                        self.remove(next(iter(self._terminal)))
        return state

    def remove(self, session_id: str) -> None:
        record = self._records.pop(session_id, None)
        self._terminal.pop(session_id, None)
        if record is not None:
            self._by_room.pop(record.room, None)
            self._by_status[record.status] -= 1

    def expired(self, now: float) -> list[SessionRecord]:
        """Live records whose session timeout has passed (by the trio clock)."""
        return [
            r for r in self._records.values()
            if not r.is_terminal and r.deadline is not None and now >= r.deadline
        ]

    def prune(self, now: float, *, retention_seconds: float, retention_count: int) -> list[str]:
        """Forget terminal records older than the retention time, and the oldest beyond the count (they are kept in
        the order they ended: the oldest first)."""
        removed = []
        for session_id in self._terminal:
            aged = now - self._records[session_id].terminal_since >= retention_seconds  # type: ignore[operator]
            if not aged and len(self._terminal) - len(removed) <= retention_count:
                break
            removed.append(session_id)
        for session_id in removed:
            self.remove(session_id)
        return removed

"""Shared helpers for the execution-lease book tests: the unit tests' idle timeout,
state shorthands, and small builders (not a test module)."""

from __future__ import annotations

from states.lease import State
from states.lease_book import LeaseBook, LeaseTransition

T = 10.0  # idle timeout used by the unit tests

W, Q, A, P, C = State.WAITING, State.QUEUED, State.ACTIVE, State.PARKED, State.CLOSING


def tr(session_id: str, state: State) -> LeaseTransition:
    return LeaseTransition(session_id, state)


def book_with(*session_ids: str, now: float = 0.0, rotate: bool = False) -> LeaseBook:
    book = LeaseBook(T, rotate=rotate)
    for session_id in session_ids:
        book.register(session_id, now)
    return book


def states(book: LeaseBook) -> dict[str, State]:
    return {snap.session_id: snap.state for snap in book.snapshot()}

"""The admission book's queue: a FIFO whose places cost no walk, checked against a list and by the work it does.

Speed is not timed here: the work is counted. Session ids are a ``str`` subclass that counts its ``==``
comparisons (a walk of the queue compares each entry it passes), so a place, a departure or an admission that
walks the queue shows up as work growing with the queue's length.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from states.admission import AdmissionBook
from states.ranked_queue import SPARE_TICKETS, RankedQueue

import pytest


class CountedId(str):
    """A session id that counts the comparisons made with it (a dict finds it by hash and identity: none)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedId.compared += 1
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        CountedId.compared += 1
        return str.__ne__(self, other)

    __hash__ = str.__hash__


# --- the queue against a list ---------------------------------------------------------------------------------

OPS = st.lists(st.one_of(st.just(("append",)), st.tuples(st.just("pop"), st.integers(0, 10_000)),
                         st.just(("copy",)), st.just(("front",)), st.tuples(st.just("insert"), st.integers(0, 10_000))),
                  max_size=300)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_the_queue_agrees_with_a_list(ops) -> None:
    queue, model, made = RankedQueue(), [], 0
    for op in ops:
        if op[0] == "append":
            made += 1
            assert queue.append(f"s{made}", float(made)) == len(model) + 1
            model.append(f"s{made}")
        elif op[0] == "front":  # a session given back to the head
            made += 1
            queue.push_front(f"s{made}", float(made))
            model.insert(0, f"s{made}")
        elif op[0] == "insert":  # a session given back behind those given back before it
            made += 1
            place = op[1] % (len(model) + 1) + 1
            queue.insert(place, f"s{made}", float(made))
            model.insert(place - 1, f"s{made}")
        elif op[0] == "pop" and model:
            item = model.pop(op[1] % len(model))
            assert queue.pop(item) == float(item[1:])
        elif op[0] == "copy":
            copied = queue.copy()
            copied.append("other", 0.0)  # the copy is independent
            assert "other" not in queue
        assert list(queue) == model and len(queue) == len(model) and bool(queue) == bool(model)
        assert [queue.position(item) for item in model] == list(range(1, len(model) + 1))
        assert [queue.get(item) for item in model] == [float(item[1:]) for item in model]
        if model:
            assert queue.head() == model[0]
    assert queue.position("never") is None and queue.get("never") is None and "never" not in queue


def test_refusals_change_nothing() -> None:
    queue = RankedQueue()
    queue.append("a", 1.0)
    with pytest.raises(ValueError):
        queue.append("a", 2.0)
    for place in (0, 3, True):
        with pytest.raises(ValueError):
            queue.insert(place, "b", 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        queue.insert(1, "a", 2.0)
    with pytest.raises(KeyError):
        queue.pop("b")
    assert list(queue) == ["a"] and queue.get("a") == 1.0
    queue.pop("a")
    with pytest.raises(IndexError):
        queue.head()


def test_tickets_of_departed_entries_stay_bounded() -> None:
    """A queue that many pass through keeps no more tickets than twice its length and a few (it renumbers)."""
    queue = RankedQueue()
    for i in range(5_000):
        queue.append(f"s{i}", 0.0)
        if i >= 10:
            queue.pop(f"s{i - 10}")  # ten waiting at any time
            assert queue.position(f"s{i}") == 10
        assert queue.tickets_held <= 2 * len(queue) + SPARE_TICKETS + 1


# --- the book's work per session does not grow with the queue ----------------------------------------------------


def comparisons_per_session_move(queued: int) -> int:
    """Comparisons of session ids made by: the place of the last queued session, a departure from the middle, a
    promotion of the head (the session on the one slot ends), the next admission (it queues) and its place."""
    book = AdmissionBook(queue_size=queued + 1)
    book.add_worker("w0", 1, 0.0)
    book.worker_ready("w0", 0.0)
    ids = [CountedId(f"s{i}") for i in range(queued + 2)]
    for session_id in ids[: queued + 1]:
        book.admit(session_id, 1.0)  # the first takes the slot, the others queue
    CountedId.compared = 0
    assert book.queue_position(ids[queued]) == queued
    book.release(ids[queued // 2 + 1], 2.0)
    moves = book.release(ids[0], 3.0)
    assert [t.session_id for t in moves if t.kind == "promoted"] == [ids[1]]
    admission, _ = book.admit(ids[-1], 4.0)
    assert admission.queue_position == queued - 1 == book.queue_position(ids[-1])
    return CountedId.compared


def test_a_place_a_departure_and_a_promotion_cost_the_same_with_10_or_1000_queued() -> None:
    """They walked the queue: each was as many comparisons as sessions ahead (ending 10,000 queued sessions one by
    one, 10,000 x 10,000 steps)."""
    few, many = comparisons_per_session_move(10), comparisons_per_session_move(1_000)
    assert many == few, (few, many)
    assert many <= 4  # a worker's own few sessions (its capacity: 1 here) may be compared, never the queue

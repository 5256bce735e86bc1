"""A FIFO whose entries know their places: every operation a lookup or O(log n), never a walk of the queue.

The admission book's queue answers "what is this session's place?" for each create, each look at a session and
each one that leaves it. Counting places by walking the queue made each of those O(n): ending n queued sessions
one by one cost n x n steps (24 s of one event loop for 10,000). Here each entry gets an arrival ticket; a
Fenwick tree over the tickets counts the entries still present, so a place is a prefix sum. Tickets of entries
that left are renumbered away once they outnumber the present ones (O(n) then, O(1) per operation amortised).

Pure: standard library only, no clock (the value kept with an id is the caller's, e.g. when it joined).
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["RankedQueue"]

#: tickets of departed entries kept before they are renumbered away (besides as many as there are entries)
SPARE_TICKETS = 32


class RankedQueue:
    """Ids in arrival order, each with a value; append, remove anywhere, head and place in O(log n) at most."""

    __slots__ = ("_tickets", "_values", "_by_ticket", "_tree", "_head")

    def __init__(self) -> None:
        self._tickets: dict[str, int] = {}  # id -> its ticket: its index in _by_ticket
        self._values: dict[str, float] = {}  # id -> the value it came with
        self._by_ticket: list[str | None] = []  # ids by ticket; None where one left
        self._tree: list[int] = [0]  # Fenwick tree over _by_ticket (1-based): 1 per present id
        self._head = 0  # no present id has a ticket below this

    def copy(self) -> RankedQueue:
        other = RankedQueue.__new__(RankedQueue)
        other._tickets = dict(self._tickets)
        other._values = dict(self._values)
        other._by_ticket = list(self._by_ticket)
        other._tree = list(self._tree)
        other._head = self._head
        return other

    # -- queries --

    def __len__(self) -> int:
        return len(self._tickets)

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def __contains__(self, item: object) -> bool:
        return item in self._tickets

    def __iter__(self) -> Iterator[str]:
        """Ids head first, one at a time (a pass over the queue: for views of all of it, or its first few; it copied
        the whole queue before the first). The queue must not change while it is iterated."""
        tickets = self._by_ticket
        return (tickets[ticket] for ticket in range(self._head, len(tickets)) if tickets[ticket] is not None)

    @property
    def tickets_held(self) -> int:
        """Tickets kept, of present and departed entries: at most twice the entries and :data:`SPARE_TICKETS`."""
        return len(self._by_ticket) - self._head

    def get(self, item: str) -> float | None:
        """The value ``item`` came with, or None when it is not queued."""
        return self._values.get(item)

    def head(self) -> str:
        """The id that came first of those queued (IndexError when none is)."""
        item = self._by_ticket[self._head] if self._tickets else None
        if item is None:
            raise IndexError("the queue is empty")
        return item

    def position(self, item: str) -> int | None:
        """The 1-based place of ``item``, or None when it is not queued."""
        ticket = self._tickets.get(item)
        return None if ticket is None else self._present_below(ticket + 1)

    # -- changes --

    def append(self, item: str, value: float) -> int:
        """Queue ``item`` at the tail (it must not be queued); returns its place."""
        if item in self._tickets:
            raise ValueError(f"{item!r} is already queued")
        ticket = len(self._by_ticket)
        self._by_ticket.append(item)
        self._tickets[item] = ticket
        self._values[item] = value
        # the new node covers tickets (index - lowbit, index]: the present ones before it, and itself
        index = ticket + 1
        self._tree.append(1 + self._present_below(index - 1) - self._present_below(index - (index & -index)))
        return len(self._tickets)

    def push_front(self, item: str, value: float) -> None:
        """Queue ``item`` at the head (it must not be queued): a session given back by its worker before it ran."""
        if item in self._tickets:
            raise ValueError(f"{item!r} is already queued")
        if self._head == 0:  # no departed ticket before the head: renumber with a free one in front (O(n), rare)
            self._by_ticket.insert(0, None)
            self._renumber_from(1)
        self._head -= 1  # the ticket before the head is a departed one's: reuse it
        ticket = self._head
        self._by_ticket[ticket] = item
        self._tickets[item] = ticket
        self._values[item] = value
        index = ticket + 1
        while index < len(self._tree):
            self._tree[index] += 1
            index += index & -index

    def insert(self, place: int, item: str, value: float) -> None:
        """Queue ``item`` (it must not be queued) at the 1-based ``place`` (1 to one past the tail), those from that
        place on one place back: O(place x log n), for a place near the head (a session given back goes behind the
        few given back before it that were admitted before it)."""
        if item in self._tickets:
            raise ValueError(f"{item!r} is already queued")
        if isinstance(place, bool) or not isinstance(place, int) or not 1 <= place <= len(self._tickets) + 1:
            raise ValueError(f"place {place!r} is not one of 1..{len(self._tickets) + 1}")
        ahead = []
        for _ in range(place - 1):  # those ahead of it step out and come back in front of it, in their order
            head = self.head()
            ahead.append((head, self.pop(head)))
        self.push_front(item, value)
        for head, head_value in reversed(ahead):
            self.push_front(head, head_value)

    def pop(self, item: str) -> float:
        """Take ``item`` out wherever it is (KeyError when it is not queued); returns its value."""
        ticket = self._tickets.pop(item)
        value = self._values.pop(item)
        self._by_ticket[ticket] = None
        index = ticket + 1
        while index < len(self._tree):
            self._tree[index] -= 1
            index += index & -index
        if not self._tickets:
            self._by_ticket.clear()
            del self._tree[1:]
            self._head = 0
            return value
        while self._by_ticket[self._head] is None:  # each ticket is passed once: O(1) amortised
            self._head += 1
        if len(self._by_ticket) > 2 * len(self._tickets) + SPARE_TICKETS:
            self._renumber()
        return value

    # -- internals --

    def _present_below(self, count: int) -> int:
        """How many of the first ``count`` tickets are present (a prefix sum)."""
        total = 0
        while count > 0:
            total += self._tree[count]
            count -= count & -count
        return total

    def _renumber(self) -> None:
        """Drop the tickets of departed entries: present ids get tickets 0..n-1, in order (O(n))."""
        self._by_ticket = [item for item in self._by_ticket[self._head:] if item is not None]
        self._renumber_from(0)

    def _renumber_from(self, head: int) -> None:
        """Tickets, tree and head for ``_by_ticket`` as it is, its present ids from ``head`` on (O(n))."""
        present = self._by_ticket
        self._tickets = {item: ticket for ticket, item in enumerate(present) if item is not None}
        tree = [0] + [0 if item is None else 1 for item in present]
        for index in range(1, len(tree)):  # the linear build: each node adds itself to its parent
            parent = index + (index & -index)
            if parent < len(tree):
                tree[parent] += tree[index]
        self._tree = tree
        self._head = head

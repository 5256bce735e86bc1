"""Fixed pools of per-session storage slots (reference B.5).

Session cache storage (KV, VAE temporal caches) is allocated once for the
computed capacity; sessions only borrow slot indices, so creating or closing a
session never allocates or frees device memory. The most recently released
slot is handed out first (LIFO): its storage is the likeliest to be warm.
"""

from __future__ import annotations

import threading

from .errors import EngineError, integer

__all__ = ["SlotPool", "SlotPoolFullError", "SlotReleaseError"]


class SlotPoolFullError(EngineError, RuntimeError):
    """Every slot is in use: admission should have refused the session."""


class SlotReleaseError(EngineError, ValueError):
    """A release of a slot that is out of range or not in use (a bookkeeping bug)."""


class SlotPool:
    """Hands out slot indices ``0 .. capacity-1``; thread-safe (used from stage actor threads)."""

    __slots__ = ("_capacity", "_in_use", "_lock", "_name", "_next_fresh", "_released")

    def __init__(self, capacity: int, name: str = "Session cache") -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"SlotPool name must be a non-empty string, got {name!r}")
        capacity = integer(f"{name} pool capacity", capacity, minimum=1)
        self._capacity = capacity
        self._name = name
        self._lock = threading.Lock()
        self._next_fresh = 0  # slots below this have been handed out at least once
        self._released: list[int] = []  # stack of free, previously used slots
        self._in_use: set[int] = set()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def name(self) -> str:
        return self._name

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._in_use)

    @property
    def available(self) -> int:
        with self._lock:
            return self._capacity - len(self._in_use)

    def in_use_slots(self) -> frozenset[int]:
        """The slots now held (for leak checks at shutdown)."""
        with self._lock:
            return frozenset(self._in_use)

    def try_acquire(self) -> int | None:
        """A free slot, or None when every slot is in use."""
        with self._lock:
            if self._released:
                slot = self._released.pop()
            elif self._next_fresh < self._capacity:
                slot = self._next_fresh
                self._next_fresh += 1
            else:
                return None
            self._in_use.add(slot)
            return slot

    def acquire(self) -> int:
        """A free slot; raises :class:`SlotPoolFullError` when every slot is in use."""
        slot = self.try_acquire()
        if slot is None:
            raise SlotPoolFullError(f"{self._name} pool is full (capacity={self._capacity})")
        return slot

    def release(self, slot: int) -> None:
        """Return ``slot``; it becomes the next one handed out."""
        try:
            slot = integer("slot", slot, minimum=0)
        except ValueError as exc:
            raise SlotReleaseError(f"{self._name} pool: {exc}") from None
        if slot >= self._capacity:
            raise SlotReleaseError(
                f"{self._name} pool: slot {slot} is outside capacity (valid 0..{self._capacity - 1})"
            )
        with self._lock:
            if slot not in self._in_use:
                raise SlotReleaseError(
                    f"{self._name} pool: slot {slot} is not in use (released twice or never acquired)"
                )
            self._in_use.remove(slot)
            self._released.append(slot)

    def __repr__(self) -> str:
        return f"SlotPool(name={self._name!r}, capacity={self._capacity}, in_use={self.in_use})"

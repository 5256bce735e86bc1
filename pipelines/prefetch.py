"""Condition prefetch: keep up to two condition requests admitted ahead of the controls.

A session's encode work for chunk ``i`` needs no control, so it can run before
the control of chunk ``i`` arrives. The window keeps two such requests in the
orchestrator at any time, so that when a control arrives its condition is
usually already encoded and only denoise and decode stand between the control
and its frames. The invariant, always:

    0 <= next_condition_index - next_control_index <= DEPTH (= 2)

- startup admits condition[0] and condition[1] (fewer for shorter sessions);
- after denoise of chunk i finishes, :meth:`refill` tops the window up
  (normally condition[i+2]), so the encode overlaps the decode, not the denoise;
- a control must be for exactly ``next_control_index``: duplicates, skipped and
  out-of-order indices are refused;
- when backpressure kept the matching condition out, the control and its
  condition are admitted together, atomically;
- condition-only ingress never starts the control-to-output timer: the
  pipeline's latency anchor is the control artifact.

This is model policy above the generic scheduler; the orchestrator knows none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine import Session

__all__ = ["ConditionPrefetch", "ControlOrderError", "DEPTH"]

DEPTH = 2


class ControlOrderError(ValueError):
    """A control for the wrong chunk index (duplicate, skipped or out of order)."""


class ConditionPrefetch:
    def __init__(
        self,
        session: Session,
        *,
        make_condition: Callable[[int], Any],
        chunk_count: int | None = None,
        condition_artifact: str = "encode_request",
        control_artifact: str = "control",
    ) -> None:
        if chunk_count is not None and chunk_count < 1:
            raise ValueError(f"chunk_count must be >= 1, got {chunk_count}")
        self._session = session
        self._make_condition = make_condition
        self.chunk_count = chunk_count
        self._condition = condition_artifact
        self._control = control_artifact
        self.next_condition_index = 0
        self.next_control_index = 0

    def _in_range(self, index: int) -> bool:
        return self.chunk_count is None or index < self.chunk_count

    def refill(self) -> int:
        """Admit conditions until the window is full or an edge is; returns how many."""
        admitted = 0
        while (
            self.next_condition_index - self.next_control_index < DEPTH
            and self._in_range(self.next_condition_index)
        ):
            index = self.next_condition_index
            if not self._session.try_push(index, {self._condition: self._make_condition(index)}):
                break
            self.next_condition_index += 1
            admitted += 1
        return admitted

    # startup is the first refill
    prime = refill

    def _check_index(self, index: int) -> None:
        if not self._in_range(index):
            raise ControlOrderError(f"chunk {index} is past the last chunk ({self.chunk_count - 1})")  # type: ignore[operator]
        if index != self.next_control_index:
            what = "already has its control" if index < self.next_control_index else "skips ahead"
            raise ControlOrderError(
                f"control for chunk {index} {what}; the next control must be for chunk {self.next_control_index}"
            )

    def can_submit(self, index: int) -> bool:
        """Whether :meth:`try_submit` would admit ``index`` now (pure: never starts an encode)."""
        try:
            self._check_index(index)
        except ControlOrderError:
            return False
        names = [self._control]
        if index >= self.next_condition_index:
            names.append(self._condition)
        return self._session.can_push(names, sequence_id=index)

    def try_submit(self, index: int, control: Any) -> bool:
        """Admit the control for ``index`` (with its condition if that is still missing)."""
        self._check_index(index)
        artifacts = {self._control: control}
        with_condition = index >= self.next_condition_index
        if with_condition:
            artifacts[self._condition] = self._make_condition(index)
        if not self._session.try_push(index, artifacts):
            return False
        self.next_control_index += 1
        if with_condition:
            self.next_condition_index = index + 1
        return True

    async def submit(self, index: int, control: Any) -> None:
        """Admit the control for ``index``, waiting for room on its edges (backpressure)."""
        self._check_index(index)
        while not self.try_submit(index, control):
            names = [self._control]
            if index >= self.next_condition_index:
                names.append(self._condition)
            await self._session.wait_for_room(names, sequence_id=index)

    def check_invariant(self) -> None:
        gap = self.next_condition_index - self.next_control_index
        if not 0 <= gap <= DEPTH:
            raise AssertionError(f"prefetch window broken: condition {self.next_condition_index}, control {self.next_control_index}")

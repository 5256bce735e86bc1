"""A rank whose results pickle in the rank process but do not load in the parent (for the worker group tests).

Runs in spawned rank processes, so it is importable as
``spec_tests.reliability.unloadable_ranks:<name>`` and imports nothing heavy.
"""

from __future__ import annotations

from typing import Any


class FailsToLoad:
    """Pickles; loading it raises (``int("not a number")``), as a ``__setstate__`` that raises would."""

    def __reduce__(self) -> tuple[Any, ...]:
        return int, ("not a number",)


class UnloadableRank:
    def __init__(self, *, rank: int, world_size: int, device: str) -> None:
        self.rank = rank

    def step(self, x: int) -> int:
        return x + self.rank

    def unloadable(self) -> Any:
        return {"latent": FailsToLoad()}

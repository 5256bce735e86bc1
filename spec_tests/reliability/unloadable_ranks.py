"""A rank whose results pickle in the rank process but do not load in the parent (for the worker group tests).

Runs in spawned rank processes, so it is importable as
``spec_tests.reliability.unloadable_ranks:<name>`` and imports nothing heavy.
"""

from __future__ import annotations

import os
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


class SharedTensorRank(UnloadableRank):
    """Returns CPU tensors (torch, imported here, in the rank only), which travel as handles to shared memory that
    the rank holds until the parent fetches them."""

    def __init__(self, *, rank: int, world_size: int, device: str) -> None:
        super().__init__(rank=rank, world_size=world_size, device=device)
        import torch

        self.torch = torch

    def half_loadable(self) -> Any:
        """Loading stops half-way: the first tensor is fetched, the second is not."""
        return {"fetched": self.torch.ones(64), "latent": FailsToLoad(), "held": self.torch.ones(64)}

    def fails_on_rank_0(self) -> Any:
        if self.rank == 0:
            raise ValueError("rank 0 failed")
        return {"latent": self.torch.ones(64)}

    def take_channel(self, channel: Any) -> None:
        """Keep ``channel`` (a ``WorkerTensorChannel`` the parent made): rank 0 is its producer."""
        self.channel = channel

    def sends_unloadable(self) -> Any:
        """Rank 0 sends a tensor on its channel and returns the ref inside a value that does not load."""
        if self.rank != 0:
            return None
        return {"latent": self.channel.send(self.torch.ones(64)), "broken": FailsToLoad()}

    def sends_then_rank_1_raises(self) -> Any:
        """Rank 0 sends a tensor on its channel and returns its ref (it loads); rank 1 raises, failing the call."""
        if self.rank == 1:
            raise ValueError("rank 1 failed")
        return {"latent": self.channel.send(self.torch.ones(64))}

    def shared_fds(self) -> int:
        """This rank's open descriptors of shared memory (every tensor it sent and nobody fetched holds one)."""
        return shared_fds_here()


def shared_fds_here() -> int:
    """This process's open descriptors of shared memory."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
        except OSError:  # the descriptor listdir itself used
            continue
    return held

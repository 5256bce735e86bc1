"""Rank classes for the tensor pipeline test (``test_tensor_pipeline``): denoise -> latent -> decode.

They run in ProcessWorkerGroup children; the test passes the WorkerTensorChannel
to them with ``functools.partial`` (the channel pickles to its name and size).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.tensor_channel import WorkerTensorChannel

LATENT_SHAPE = (1, 16, 4, 60, 104)  # float32, about 1.5 MB


def latent_for(control: int, sequence_id: int) -> torch.Tensor:
    """The latent denoise makes for a (control, sequence) pair: a pattern plus an offset."""
    pattern = torch.arange(int(np.prod(LATENT_SHAPE)), dtype=torch.float32).remainder_(251).reshape(LATENT_SHAPE)
    return pattern.add_(control + 1000 * sequence_id)


def frames_for(latent: torch.Tensor) -> np.ndarray:
    """The small "frames" decode answers for its slice of the latent (uint8)."""
    return (latent[0, :3, 0, :, :8].to(torch.int64) % 256).to(torch.uint8).numpy()


class _Rank:
    def __init__(self, *, channel: WorkerTensorChannel, rank: int, world_size: int, device: str) -> None:
        torch.set_num_threads(1)
        self.channel = channel
        self.rank = rank
        self.world_size = world_size

    def close(self) -> None:
        self.channel.detach()


class DenoiseRank(_Rank):
    def denoise(self, control: int, sequence_id: int) -> Any:
        """Make the latent and send it: only the refs go back to the scheduler."""
        return self.channel.send({"latent": latent_for(control, sequence_id)})


class DecodeRank(_Rank):
    def decode(self, refs: Any, sequence_id: int) -> dict[str, Any]:
        """Receive this rank's shard (zero-copy), check it, answer small frames and the offset it found."""
        got = self.channel.receive(refs, rank=self.rank, copy=False)
        try:
            latent = got["latent"]
            rows = torch.tensor_split(torch.arange(LATENT_SHAPE[-2]), self.world_size)[self.rank]
            pattern = latent_for(0, 0)[..., rows, :]
            offset = float(latent.flatten()[0] - pattern.flatten()[0])
            if tuple(latent.shape) != tuple(pattern.shape) or not torch.equal(latent - offset, pattern):
                raise AssertionError(f"rank {self.rank}: latent of sequence {sequence_id} is not what denoise made")
            frames = frames_for(latent)
        finally:
            del got
            latent = None
            self.channel.release(refs, rank=self.rank)
        return {"rank": self.rank, "offset": offset, "frames": frames, "rows": (int(rows[0]), int(rows[-1]) + 1)}


class SendingRank(_Rank):
    """Sends ``n`` ones on the channel; ``then_fail``: then raises, so the refs never leave the rank."""

    def send_ones(self, n: int, *, then_fail: bool = False) -> Any:
        refs = self.channel.send({"ones": torch.ones(n)})
        if then_fail:
            raise ValueError("a failure after the send")
        return refs

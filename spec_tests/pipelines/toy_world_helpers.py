"""What the toy world model tests share (``test_toy_world_model.py``, ``test_toy_world_motion.py``): the small
frame size most checks render at, and chunks generated from a pose with keys held. Their fixtures (the models,
one intra-op thread) are in this package's ``conftest.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from pipelines.toy_world.model import IDENTITY_POSE, ToyWorldConfig, ToyWorldModel

SMALL = dict(height=48, width=80)


def fresh_cache(config: ToyWorldConfig) -> torch.Tensor:
    return torch.zeros(config.cache_frames, config.latent_channels, *config.latent_size)


def run_chunks(model: ToyWorldModel, keys: str, chunks: int = 1, *, image=None, prompt=None, pose=IDENTITY_POSE):
    """The frames of ``chunks`` chunks from ``pose`` with ``keys`` held, concatenated, and the poses."""
    world = model.encode_world(image, prompt)
    cache = fresh_cache(model.config)
    frames, all_poses = [], []
    for index in range(chunks):
        chunk, poses = model.generate_chunk(world, pose, frozenset(keys), cache, noise_seed=index)
        frames.append(chunk)
        all_poses += poses
        pose = poses[-1]
    return np.concatenate(frames), all_poses


def frames_of(model: ToyWorldModel, keys: str, chunks: int = 1, **kw) -> np.ndarray:
    return run_chunks(model, keys, chunks, **kw)[0]


def grey(frame: np.ndarray) -> np.ndarray:
    return frame.astype(np.float64).mean(axis=-1)

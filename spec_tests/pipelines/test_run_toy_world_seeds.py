"""Every ``--seed`` that ``chunkline run`` takes (0 to 2**63-1) makes a toy world.

A chunk's noise seed was ``seed * 1_000_003 + index``, past a torch generator's 2**64 - 1 from a seed of about
2**44 on: ``--seed 1125899906842624`` (2**50) loaded the pipeline and then failed the run, exit 1, ``Overflow when
unpacking long long``. It is reduced mod 2**64 now (``pipelines.toy_world.model.chunk_noise_seed``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import pipelines
from pipelines.toy_world.model import chunk_noise_seed

from .cli_runs import run_pipeline

TOY_WORLD = Path(pipelines.__file__).parent / "toy_world"


@pytest.mark.parametrize("seed", [2**50, 2**63 - 1])
def test_a_large_seed_makes_the_world(tmp_path: Path, seed: int) -> None:
    ran = run_pipeline(tmp_path, TOY_WORLD, "--seed", str(seed), chunks=2)
    assert ran.code == 0, ran.stderr[-2000:]
    assert sorted(path.name for path in ran.out.iterdir()) == ["metrics.json", "video.mp4"]


def test_small_seeds_keep_their_noise_and_share_none() -> None:
    """The reduction changes nothing that fitted (the same frames as before for every seed that worked), and two
    small seeds' chunks never draw the same noise."""
    assert [chunk_noise_seed(3, index) for index in (0, 1, 7)] == [3_000_009, 3_000_010, 3_000_016]
    seeds = {chunk_noise_seed(seed, index) for seed in range(50) for index in range(200)}
    assert len(seeds) == 50 * 200 and all(0 <= noise < 2**64 for noise in seeds)

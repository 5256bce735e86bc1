"""The toy world copied out of the tree as the start of a pipeline of one's own runs as it is.

A new user who copied ``pipelines/toy_world`` to a folder of their own and ran it got ``attempted relative import
beyond top-level package``: the toy world imported the shared pipeline modules as ``..contract``, which reaches the
``pipelines`` package only from inside it. It imports them by their full names now, as a user's pipeline would.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pipelines

from .cli_runs import run_pipeline

TOY_WORLD = Path(pipelines.__file__).parent / "toy_world"


def test_a_copy_of_the_toy_world_outside_the_tree_runs(tmp_path: Path) -> None:
    copy = tmp_path / "my_world"
    shutil.copytree(TOY_WORLD, copy, ignore=shutil.ignore_patterns("__pycache__"))
    ran = run_pipeline(tmp_path, copy, chunks=1)
    assert ran.code == 0, ran.stderr[-2000:]
    assert (ran.out / "video.mp4").stat().st_size > 0

"""``chunkline run --prompt/--image`` for a pipeline whose service does not take them exits 2 naming the flag.

The replay pipeline takes neither (``takes_prompt = takes_image = False``); ``chunkline run pipelines/replay
--prompt x --image FILE`` made the pattern and exited 0, as though both had been used. Now one line names the
first flag the pipeline does not take, nothing is written, and a pipeline of a user's own that declares one of them
(a class attribute) is held to it the same way. Each run is a real process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pipelines
from server.run_inputs import shown

from ..server.conftest import png_bytes

ROOT = Path(pipelines.__file__).parents[1]


def chunkline_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "run", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def refusal(flag: str, name: str, pipeline: str) -> str:
    return (f"chunkline run: {flag}: pipeline {shown(pipeline)} takes no {name} (its service declares takes_{name} = "
            f"False); leave it out\n")


@pytest.mark.parametrize(("flags", "refused"), [
    (["--prompt", "a snowy street"], ("--prompt", "prompt")),
    (["--image", "IMAGE"], ("--image", "image")),
    (["--prompt", "x", "--image", "IMAGE"], ("--prompt", "prompt")),  # the first flag it does not take
])
def test_replay_refuses_a_prompt_and_an_image_with_exit_2_and_writes_nothing(
    tmp_path: Path, flags: list[str], refused: tuple[str, str]
) -> None:
    image = tmp_path / "ref.png"
    image.write_bytes(png_bytes())
    out = tmp_path / "out"
    done = chunkline_run("pipelines/replay", "--chunks", "2", "--out", str(out),
                         *[str(image) if flag == "IMAGE" else flag for flag in flags])
    assert done.returncode == 2, done.stderr
    assert done.stderr == refusal(*refused, "pipelines/replay")
    assert not out.exists()


def test_a_pipeline_of_ones_own_that_takes_no_image_is_refused_one_and_given_the_prompt(tmp_path: Path) -> None:
    pipeline = tmp_path / "no_image_world.py"
    pipeline.write_text(
        "from spec_tests.pipelines.offline_helpers import CounterWorld\n\n"
        "class NoImageWorld(CounterWorld):\n"
        "    takes_image = False\n\n"
        "def get_service(gpu_num=0):\n"
        "    return NoImageWorld()\n"
    )
    image = tmp_path / "ref.png"
    image.write_bytes(png_bytes())
    refused = chunkline_run(str(pipeline), "--chunks", "2", "--prompt", "a street", "--image", str(image),
                            "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr == refusal("--image", "image", str(pipeline))
    taken = chunkline_run(str(pipeline), "--chunks", "2", "--prompt", "a street", "--out", str(tmp_path / "out"))
    assert taken.returncode == 0, taken.stderr
    assert (tmp_path / "out" / "video.mp4").is_file()

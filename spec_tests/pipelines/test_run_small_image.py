"""``chunkline run --image`` of an image the pipeline's ``check_image`` refuses is bad input: exit 2, naming the flag,
before any session is made (the server's ``invalid_image`` for the same file).

The toy world's session was created and its encode stage failed it (``the run failed: the pipeline failed making
chunk 0: PipelineFailed: ... at least 2 x 2``, exit 1, as if the pipeline had failed); a pipeline's own
``check_image`` was never asked, and the run took an image the server refuses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_runs import ROOT, Ran, failed_line, run_pipeline, write_png


@pytest.mark.parametrize(("width", "height"), [(1, 1), (40, 1), (1000, 1), (1, 3000)])
def test_an_image_under_two_by_two_pixels_is_bad_input(tmp_path: Path, width: int, height: int) -> None:
    """The size said is the file's own, not the size its pixels are scaled down to as they are read (a 1000 x 1
    image was said to be 320 x 1, a 1 x 3000 one 1 x 192)."""
    image = tmp_path / "dot.png"
    write_png(image, width, height)
    ran = run_pipeline(tmp_path, ROOT / "pipelines" / "toy_world", "--image", str(image), chunks=1)
    assert failed_line(ran, code=2) == (
        f"chunkline run: --image: the image is {width} x {height} pixels; the toy world takes one of at least 2 x 2")


PICKY = """
from spec_tests.pipelines.minimal_service import MinimalService


class Picky(MinimalService):
    takes_image = True

    async def check_image(self, width, height):
        if width < 100:
            {refusal}


def get_service(gpu_num=0):
    return Picky()
"""


def _run_picky(tmp_path: Path, refusal: str) -> Ran:
    """``chunkline run --image`` of a 20 x 20 image with a pipeline whose ``check_image`` runs ``refusal`` for it."""
    image = tmp_path / "small.png"
    write_png(image, 20, 20)
    pipeline = tmp_path / "picky.py"
    pipeline.write_text(PICKY.format(refusal=refusal))
    return run_pipeline(tmp_path, pipeline, "--image", str(image), chunks=1)


def test_an_image_the_pipelines_own_check_refuses_is_bad_input_before_the_session(tmp_path: Path) -> None:
    ran = _run_picky(tmp_path, "raise ValueError(f'the image is {width} x {height}; need >= 100 wide')")
    assert failed_line(ran, code=2) == "chunkline run: --image: the image is 20 x 20; need >= 100 wide"


def test_an_image_check_that_raises_other_than_value_error_is_the_pipelines_bug(tmp_path: Path) -> None:
    line = failed_line(_run_picky(tmp_path, "raise TypeError('width')"), code=1)
    assert line.startswith("chunkline run: the run failed: pipeline bug: check_image raised TypeError: width"), line

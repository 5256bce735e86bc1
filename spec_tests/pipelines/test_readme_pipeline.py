"""The README's pipeline of one's own ("A pipeline of one's own") runs as written: offline with ``chunkline run``, and
its option check refuses a bad value as the README says a ``ValueError`` there is told (exit 2, naming ``--option``).
A new user had no example smaller than the toy world, and had to guess the import line."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .cli_runs import ROOT, run_pipeline

SECTION = "### A pipeline of one's own"


def readme_pipeline() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION):]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "the section has no python block"
    return found.group(1)


def test_the_readme_pipeline_runs_as_written(tmp_path: Path) -> None:
    pipeline = tmp_path / "greys.py"
    pipeline.write_text(readme_pipeline())
    ran = run_pipeline(tmp_path, pipeline, "--option", "level=200", chunks=3)
    assert ran.code == 0, ran.stderr[-2000:]
    metrics = json.loads((ran.out / "metrics.json").read_text())
    assert (metrics["chunks"], metrics["frames"], metrics["width"], metrics["fps"]) == (3, 12, 64, 16.0), metrics
    assert (ran.out / "video.mp4").stat().st_size > 0


def test_the_readme_pipeline_refuses_a_bad_option_naming_it(tmp_path: Path) -> None:
    pipeline = tmp_path / "greys.py"
    pipeline.write_text(readme_pipeline())
    ran = run_pipeline(tmp_path, pipeline, "--option", "level=300", chunks=3)
    assert ran.code == 2, ran.stderr[-2000:]
    assert ran.lines[-1] == "chunkline run: --option: option 'level' must be an int in 0..255, got 300", ran.lines
    assert not ran.out.exists() or not any(ran.out.iterdir())

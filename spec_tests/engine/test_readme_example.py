"""The engine's example in the README runs as written: a new user's first program (it waited for ever after its
first output: one push for a session told to end at sequence 99, and its handlers were never defined)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_engine_example_runs_to_its_last_sequence():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("A trio-native streaming pipeline scheduler."):]
    example = section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]
    done = subprocess.run([sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 100 and lines[0] == "0 frame 1" and lines[-1] == "99 frame 199", done.stdout[-500:]

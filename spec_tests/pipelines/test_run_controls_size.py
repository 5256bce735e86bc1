"""A controls file holds the 200,000 entries the docs promise (``pipelines/timed_controls.py``, the README).

``chunkline run`` parsed it with the server's limit on a client's JSON, 20,000 values, so a file of 5,000 entries
was refused (``JSON of 40000 values; at most 20000 allowed``), while the README named only the 16 MiB cap and the
code "about 200,000 entries". Past 200,000 entries a file is refused naming the limit (``test_run_inputs.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.timed_controls import MAX_CONTROLS_ENTRIES, MAX_CONTROLS_FILE_BYTES

from .cli_runs import run_pipeline

PIPELINE = """\
from spec_tests.pipelines.minimal_service import MinimalService


def get_service(gpu_num=0):
    return MinimalService()
"""


def test_a_controls_file_of_the_most_entries_of_the_largest_kind_is_run(tmp_path: Path) -> None:
    """200,000 entries of every key held (the entry of the most JSON values), timed past the run: none is pushed."""
    entry = {"t": 3600, "type": "control_state", "controls": list("wasdijkl")}
    controls = tmp_path / "controls.json"
    controls.write_text(json.dumps([entry] * MAX_CONTROLS_ENTRIES, separators=(",", ":")))
    assert controls.stat().st_size <= MAX_CONTROLS_FILE_BYTES
    ran = run_pipeline(tmp_path, PIPELINE, "--controls", str(controls), chunks=1)
    assert ran.code == 0, ran.stderr[-2000:]
    metrics = json.loads((ran.out / "metrics.json").read_text())
    assert metrics["controls"]["scheduled"] == MAX_CONTROLS_ENTRIES
    assert metrics["controls"]["not_reached"] == MAX_CONTROLS_ENTRIES

"""A mistyped ``chunkline`` command line is one line on stderr naming the command and what was wrong, exit code 2.

argparse printed the command's whole usage first (35 lines for ``stream-serve``, the error last), and an unknown
argument after a command was told as the top command's: ``chunkline: error: unrecognized arguments: extra`` under
``chunkline [-h] COMMAND ...``, not naming ``run``. Through real processes, as a user types them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 60.0  # wall seconds: a loaded 2-core host imports the command line


@pytest.mark.parametrize(("words", "line"), [
    ([], "chunkline: error: the following arguments are required: COMMAND (see chunkline --help)"),
    (["run", "pipelines/replay", "extra"],
     "chunkline run: error: unrecognized arguments: extra (see chunkline run --help)"),
    (["run", "pipelines/replay", "--chunks"],
     "chunkline run: error: argument --chunks: expected one argument (see chunkline run --help)"),
    (["run", "pipelines/replay", "--chunks", "1_0"],  # Python's int took it for 10
     "chunkline run: error: argument --chunks: not an integer: '1_0' (see chunkline run --help)"),
    (["run", "pipelines/replay", "--chunks", "\u0662"],  # an Arabic-Indic two, which int took for 2
     "chunkline run: error: argument --chunks: not an integer: '\u0662' (see chunkline run --help)"),
    (["stream-serve", "pipelines/replay", "--bogus"],
     "chunkline stream-serve: error: unrecognized arguments: --bogus (see chunkline stream-serve --help)"),
    (["stream-serve", "--port"],
     "chunkline stream-serve: error: argument --port/-p: expected one argument (see chunkline stream-serve --help)"),
    (["worker", "pipelines/replay"],
     "chunkline worker: error: the following arguments are required: --authority (see chunkline worker --help)"),
], ids=["no_command", "run_extra", "run_no_value", "run_underscored", "run_other_script", "serve_unknown", "serve_no_value", "worker_required"])
def test_a_usage_error_is_one_line_naming_the_command(words: list[str], line: str) -> None:
    done = subprocess.run([sys.executable, "-m", "server.cli", *words], cwd=ROOT, capture_output=True, text=True,
                          timeout=DEADLINE)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")


def test_stream_serve_help_says_each_option_s_default_once() -> None:
    """An option whose help names its default (``--cluster-host``: "default: --host") was then also "default unset"."""
    done = subprocess.run([sys.executable, "-m", "server.cli", "stream-serve", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=DEADLINE, env={**os.environ, "COLUMNS": "400"})  # one line an option
    assert done.returncode == 0
    helps = [line for line in done.stdout.splitlines() if "env CHUNKLINE_" in line]
    assert len(helps) > 30
    assert [line for line in helps if "default:" in line and "(default " in line] == []
    assert any("--cluster-host HOST" in line and "(default: --host) (env CHUNKLINE_CLUSTER_HOST)" in line
               for line in helps)

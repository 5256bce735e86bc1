"""``chunkline worker`` with an option it would not use: refused in one line, exit 2, before the pipeline loads.

``--tls-ca`` with a ``tcp://`` authority was taken and ignored: the agent dialed without TLS, its cluster token and
sessions in the clear, while its user believed the CA was checked. ``chunkline stream-serve`` already refuses an
option that would be ignored (Settings checks). Through a real process, as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 120.0  # wall seconds: a loaded 2-core host imports the cluster stack


def test_a_tls_ca_for_a_tcp_authority_is_refused_naming_both(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env["CHUNKLINE_CLUSTER_TOKEN"] = "t" * 32
    # --default-fps 0 is checked later: without this refusal it is the line, and no agent dials
    done = subprocess.run([sys.executable, "-m", "server.cli", "worker", "pipelines/replay",
                           "--authority", "tcp://127.0.0.1:45999", "--tls-ca", str(ca), "--default-fps", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "chunkline worker: error: --tls-ca applies to a tls:// authority; with 'tcp://127.0.0.1:45999' it "
               "would be ignored (the agent dials it without TLS)\n")


def test_worker_help_lists_its_exit_codes() -> None:
    """The codes were only in the module's docstring, which left out a stop before it served (128 + the signal)."""
    done = subprocess.run([sys.executable, "-m", "server.cli", "worker", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=DEADLINE, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0
    assert done.stdout.rstrip().splitlines()[-1].startswith("Exit codes: 0 drained")
    for words in ("2 bad arguments", "3 refused", "128 + the signal for a stop before it served (130 for Ctrl-C)"):
        assert words in done.stdout

"""The harness cleans up after runs that were killed before their own cleanup."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from server.livekit_local import PrivateNetwork, remove_stale_networks, work_folder


@pytest.mark.parametrize("ending", ["done", "ctrl_c", "failed"])
def test_a_runs_work_folder_goes_at_its_end_unless_the_run_failed(
    ending: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The config (with its secret) and logs of `make run LIVEKIT=1` and bench.livekit: kept only to read a failure."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    raised = {"done": None, "ctrl_c": KeyboardInterrupt, "failed": RuntimeError}[ending]
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        with work_folder("chunkline-livekit-") as folder:
            (folder / "livekit.yaml").write_text("keys: secret")
            if raised:
                raise raised
    assert [path.name for path in tmp_path.iterdir()] == ([folder.name] if ending == "failed" else [])
    assert (f"kept in {folder}" in capsys.readouterr().err) == (ending == "failed")


@pytest.mark.livekit
def test_namespaces_of_dead_runs_are_removed_and_live_ones_kept(livekit_binary: Path) -> None:
    live = PrivateNetwork.create()  # made by this process, which is alive
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = f"chunkline-lk-{dead.stdout.strip()}-0dead0"  # as a run killed before its cleanup leaves it
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_stale_networks("chunkline-lk")
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert stale not in listed and live.name in listed
    finally:
        live.destroy()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)

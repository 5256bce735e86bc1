"""The harness cleans up after runs that were killed before their own cleanup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.livekit_local import PrivateNetwork, remove_stale_networks

pytestmark = pytest.mark.livekit


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

"""Running a Python script in a mount namespace of its own with a small /dev/shm, or a pid namespace of its own: as
root with ``unshare(1)``, as the LiveKit tests need too. In CI such a test must run: it fails there rather than skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

__all__ = ["in_another_pid_namespace", "with_small_dev_shm"]


def _needs_root(what: str) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        reason = f"needs root and unshare(1) for {what}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: this test must run, never skip: {reason}")
        pytest.skip(reason)


def with_small_dev_shm(script: str, size: str = "1m") -> subprocess.CompletedProcess[str]:
    """``script`` run by this Python with a tmpfs of ``size`` as /dev/shm."""
    _needs_root("a mount namespace with a small /dev/shm")
    shell = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" -c "$1"'  # the script as an argument, unquoted
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell, sys.executable, script],
                          capture_output=True, text=True, timeout=120)


def in_another_pid_namespace(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by this Python in a pid namespace of its own (its /proc too), sharing this /dev/shm."""
    _needs_root("a pid namespace")
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=120, cwd=os.getcwd())

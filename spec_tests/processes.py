"""What every test that starts a server process does on its way out, however it ends."""

from __future__ import annotations

import subprocess

import trio

__all__ = ["end_popen", "end_process"]


async def end_process(process: trio.Process) -> None:
    """Kill ``process`` unless it already ended, and reap it even while the test is being cancelled."""
    if process.returncode is None:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


def end_popen(process: subprocess.Popen) -> None:
    """The same for a ``subprocess.Popen``: kill it unless it already ended, reap it, close its pipes."""
    if process.poll() is None:
        process.kill()
    process.communicate()

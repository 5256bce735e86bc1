"""A rank module whose import, in a spawned rank, waits at a gate (as a pipeline's import of torch takes seconds).

With ``CHUNKLINE_TEST_IMPORT_GATE`` set to a folder, a process importing this module writes its pid to
``<folder>/importing`` and waits until ``<folder>/open`` exists (bounded). A spawned rank imports it while it
unpickles its factory, before any of the rank's own code runs. Unset (the test process's own import), nothing waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .worker_ranks import EchoRank

_gate = os.environ.get("CHUNKLINE_TEST_IMPORT_GATE")
if _gate:
    (Path(_gate) / "importing").write_text(str(os.getpid()))
    _deadline = time.monotonic() + 30.0
    while not (Path(_gate) / "open").exists() and time.monotonic() < _deadline:
        time.sleep(0.01)  # bench-cost: an import that takes its time, until the test opens the gate (bounded)


def factory(*, rank: int, world_size: int, device: str) -> Any:
    return EchoRank(rank=rank, world_size=world_size, device=device)

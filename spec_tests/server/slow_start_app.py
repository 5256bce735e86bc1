"""``server:app`` as a slow start holds it: ``hypercorn spec_tests.server.slow_start_app:app`` imports ``server``
(whose first line takes the stop signals in hypercorn's worker), builds the app too if ``$SLOW_START/build`` exists,
then writes its process id to ``$SLOW_START/starting`` and waits (30 s at most) for ``$SLOW_START/go``, as a heavy
import (torch, a pipeline's package) holds hypercorn's worker before it serves."""

import os
import time
from pathlib import Path

import server

app = server.app  # the lazy app (once built, ``server.app`` names the module ``server/app.py``)
gate = Path(os.environ["SLOW_START"])
if (gate / "build").exists():
    app.extensions  # noqa: B018 - built now (hypercorn builds it as it loads it)
# whole or not at all: the test reads the pid as soon as the file exists (written in place, it was read empty once)
(gate / "starting.tmp").write_text(str(os.getpid()))
os.replace(gate / "starting.tmp", gate / "starting")
give_up = time.monotonic() + 30.0
while not (gate / "go").exists() and time.monotonic() < give_up:
    time.sleep(0.02)  # bench-cost: the start held by the test (another process) until it signalled

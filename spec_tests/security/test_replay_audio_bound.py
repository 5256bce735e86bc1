"""A replay chunk's audio counts toward its bound, so a client's low ``fps`` cannot make the server hold gigabytes.

The replay pipeline bounded a chunk's frames (64 MiB) but not the tone that goes with them: ``frames_per_chunk /
fps`` seconds of 48 kHz audio, made as one float64 wave. ``fps`` 0.05 with 1,024 frames of 16 x 16 was taken (a
200) and, once its controller joined, asked the server for 5.7 hours of audio, some 8 GB at once; ``fps`` 1e-300
failed its session with numpy's ``ValueError: Maximum allowed size exceeded`` and a traceback in the log, and
``chunkline run`` with it exited 1 as the run's failure. Now the audio counts toward the chunk's 64 MiB: the create is
a 400 ``invalid_option`` naming the options and nothing is held, and ``chunkline run`` exits 2 naming them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from .test_hostile_server import running

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import the pipeline and refuse the option

TOO_MUCH_AUDIO = [
    {"fps": 0.05, "frames_per_chunk": 1024, "width": 16, "height": 16},  # 20,480 s a chunk: ~2 GB PCM, ~8 GB made
    {"fps": 1e-300},  # 8e300 s a chunk
]


async def test_a_create_whose_chunks_would_hold_too_much_audio_is_refused_before_anything_is_held() -> None:
    async with running() as server:
        for config in TOO_MUCH_AUDIO:
            status, body = await server.request("POST", "/v1/stream/sessions", {"identity": "ctl", "config": config})
            assert status == 400 and body["error"] == "invalid_option", (config, status, body)
            assert "'frames_per_chunk' / 'fps' make" in body["detail"] and "s of audio a chunk" in body["detail"], body
            assert "at most 67108864 bytes" in body["detail"], body
        listed = (await server.request("GET", "/v1/stream/sessions"))[1]["sessions"]
        assert listed == []
        health = (await server.request("GET", "/v1/service/health"))[1]
        assert health["free_slots"] == 1 and health["status"] == "healthy", health


def test_chunkline_run_refuses_the_option_as_bad_input_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", "pipelines/replay", "--chunks", "2",
                           "--option", "fps=1e-300", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE)
    last: Any = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-2000:]
    assert last.startswith("chunkline run: --option: replay options 'frames_per_chunk' / 'fps' make"), last
    assert not out.exists()

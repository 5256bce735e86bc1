"""``chunkline run`` as a user runs it, in a real process: what the run tests that write a pipeline share.

A test writes a pipeline file's text (or names a pipeline), runs the command into ``tmp_path / "out"`` and reads
what it said on stderr, its exit code and what it left.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
#: wall seconds for `chunkline run` to import torch and its pipeline, load the toy world at most, and make a few
#: small chunks (a hang bound on a loaded host, not a timing)
RUN_DEADLINE = 180.0
PROGRESS = re.compile(r"\d+/\d+ chunks ")  # the progress lines a run writes as it goes


@attrs.frozen
class Ran:
    code: int
    lines: list[str]  # stderr's lines, the progress lines left out
    stderr: str
    out: Path  # the --out folder


def run_pipeline(tmp_path: Path, pipeline: str | Path, *flags: str, chunks: int = 2,
                 deadlines: Mapping[str, float] | None = None) -> Ran:
    """``chunkline run`` of ``pipeline`` (a pipeline file's text, written to ``tmp_path / "p.py"``, or a path) for
    ``chunks`` chunks with ``flags``, into ``tmp_path / "out"``. ``deadlines`` shortens the server's constants the
    run takes its deadlines from (``{"CREATE_PIPELINE_TIMEOUT": 1.0}``, :mod:`server.runner`) in that process."""
    if isinstance(pipeline, str):
        path = tmp_path / "p.py"
        path.write_text(pipeline)
    else:
        path = pipeline
    out = tmp_path / "out"
    command = [sys.executable, "-m", "server.cli"]
    if deadlines:
        shortened = "".join(f"runner.{name} = {seconds!r}\n" for name, seconds in deadlines.items())
        command = [sys.executable, "-c", f"import sys, server.runner as runner\n{shortened}"
                                         "from server.cli import main\nsys.exit(main())\n"]
    done = subprocess.run([*command, "run", str(path), "--chunks", str(chunks), *flags, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)
    return Ran(done.returncode, [line for line in done.stderr.splitlines() if not PROGRESS.match(line)],
               done.stderr, out)


def failed_line(ran: Ran, code: int = 1) -> str:
    """The one line a failed run said, once it exited ``code`` and left nothing in its --out folder."""
    assert len(ran.lines) == 1, ran.stderr[-2000:]
    assert ran.code == code, ran.stderr[-2000:]
    assert not ran.out.exists()
    return ran.lines[0]


def one_control(tmp_path: Path) -> tuple[str, str]:
    """The flags of a controls file holding one reset at the start (a run then calls push_control)."""
    controls = tmp_path / "controls.json"
    controls.write_text('[{"t": 0, "type": "reset"}]')
    return "--controls", str(controls)


def read_stderr_until(process: subprocess.Popen[bytes], done: Callable[[bytes], bool], what: str,
                      seen: bytes = b"", within: float = RUN_DEADLINE) -> bytes:
    """A running command's stderr (``seen`` and what follows), read until ``done(it)``, within ``within`` seconds."""
    assert process.stderr is not None
    deadline = time.monotonic() + within
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while not done(seen):
            left = deadline - time.monotonic()
            assert left > 0, f"no {what} within {within} s: {seen[-500:]!r}"
            if selector.select(left):
                data = os.read(process.stderr.fileno(), 65536)
                assert data, f"the run ended before {what}: {seen[-500:]!r}"
                seen += data
    return seen


def default_signals() -> None:
    """A ``preexec_fn`` for a run the test signals: a child of a non-interactive shell may inherit SIGINT (and
    SIGQUIT) ignored."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)


def last_line(process: subprocess.Popen[bytes], seen: bytes) -> str:
    """The last line a run that ended said on stderr (``seen``: what was read of it already)."""
    assert process.stderr is not None
    return (seen + process.stderr.read()).decode().splitlines()[-1]


def write_png(path: Path, width: int, height: int) -> None:
    """A black RGB PNG of ``width`` x ``height``."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress((b"\0" + b"\0" * 3 * width) * height)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))

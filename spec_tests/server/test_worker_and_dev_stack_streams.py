"""``chunkline worker`` and the LiveKit dev stack (``make run LIVEKIT=1``) with a stdout or stderr they cannot write.

Both printed their own lines directly. ``chunkline worker`` with bad arguments and stderr closed (``2>&-``) put its
error on stdout, and with stderr on a full disk or a pipe whose reader left it exited 1 (its traceback lost) where
the arguments' exit code is 2. The dev stack did the same with its lines, and worse once running: a stdout on a
full disk failed its "LiveKit at ..." line, which stopped the stack before it served (exit 1), and a stderr gone
failed its "stopped" line, so a clean Ctrl-C or SIGTERM exited 1. A SIGHUP (its terminal closed) killed the stack
by its default action, leaving LiveKit, the stream server and the work folder behind; SIGTERM exited 130; a LiveKit
that could not start was a traceback. Through real processes, as a user runs them; the running dev stack runs in a
network namespace of its own (``unshare -rn``: its ports are private and no packet leaves), with a stand-in for the
LiveKit binary that answers its readiness check.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from ..namespaces import PRIVATE_NETWORK, unshare_or_skip

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 120.0  # wall seconds: a loaded 2-core host imports the server stack and loads the replay
WORKER = [sys.executable, "-m", "server.cli", "worker", "pipelines/replay", "--authority", "tcp://127.0.0.1:45999",
          "--devices", "x"]
DEV_STACK = [sys.executable, "-m", "server.livekit_local", "pipelines/replay", "--port", "0"]
STOPPED = "stopped the stream server and LiveKit"

# a LiveKit server as far as the dev stack can tell: GET / on the config's port answers 200
FAKE_LIVEKIT = """\
import http.server, re, sys
config = open(sys.argv[sys.argv.index("--config") + 1]).read()
port = int(re.search(r"^port: (\\d+)$", config, re.M).group(1))
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Ok).serve_forever()
"""
def env_without_chunkline(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(extra)
    return env


def run_closed_or_gone(argv: list[str], stderr: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``argv`` with its stderr closed (``2>&-``), on a full disk, or a pipe whose reader left; stdout captured."""
    if stderr == "closed":
        return subprocess.run(["sh", "-c", 'exec "$@" 2>&-', "sh", *argv], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, timeout=DEADLINE)
    if stderr == "full":
        with open("/dev/full", "wb") as full:
            return subprocess.run(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=full,
                                  timeout=DEADLINE)
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=writer,
                              timeout=DEADLINE)
    finally:
        os.close(writer)


STDERRS = pytest.mark.parametrize("stderr", ["closed", "full", "reader_left"])


@STDERRS
def test_a_worker_with_bad_arguments_exits_2_and_says_nothing_on_stdout_whatever_its_stderr(stderr: str) -> None:
    done = run_closed_or_gone(WORKER, stderr, env_without_chunkline())
    assert (done.returncode, done.stdout) == (2, "")


@STDERRS
def test_the_dev_stack_without_its_livekit_binary_exits_2_and_says_nothing_on_stdout_whatever_its_stderr(
    stderr: str, tmp_path: Path
) -> None:
    env = env_without_chunkline(CHUNKLINE_LIVEKIT_SERVER=str(tmp_path / "livekit-server"))
    done = run_closed_or_gone(DEV_STACK, stderr, env)
    assert (done.returncode, done.stdout) == (2, "")


async def start_dev_stack(tmp_path: Path, livekit: str = FAKE_LIVEKIT, **streams: object) -> trio.Process:
    """The dev stack in a network namespace of its own, with the stand-in LiveKit, in a process group of its own."""
    argv = unshare_or_skip("-rn", PRIVATE_NETWORK, *DEV_STACK)
    fake = tmp_path / "livekit-server"
    fake.write_text(f"#!{sys.executable}\n{livekit}")
    fake.chmod(0o755)
    env = env_without_chunkline(CHUNKLINE_LIVEKIT_SERVER=str(fake), TMPDIR=str(tmp_path))
    return await trio.lowlevel.open_process(argv, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                            start_new_session=True, **streams)


async def read_until(stream: trio.abc.ReceiveStream, text: bytes) -> bytes:
    seen = b""
    with trio.fail_after(DEADLINE):
        while text not in seen:
            chunk = await stream.receive_some()
            assert chunk, f"the stream ended before {text!r}: {seen.decode(errors='replace')}"
            seen += chunk
    return seen


async def end_group(process: trio.Process) -> None:
    """Kill what is left of the stack's group (the stand-in LiveKit and the stream server too, even once the stack
    itself has ended), and reap the stack."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with trio.CancelScope(shield=True):
        await process.wait()


async def test_a_dev_stack_whose_stdout_is_on_a_full_disk_serves_and_stops_with_130(short_tmp: Path) -> None:
    tmp_path = short_tmp  # the stack's server makes a Unix socket in it: pytest's tmp_path is too long under xdist
    with open("/dev/full", "wb") as full:
        process = await start_dev_stack(tmp_path, stdout=full, stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        seen = await read_until(process.stderr, b"chunkline: serving pipelines/replay")
        process.send_signal(signal.SIGINT)
        seen += await read_until(process.stderr, STOPPED.encode())
        with trio.fail_after(DEADLINE):
            assert await process.wait() == 130
    finally:
        await end_group(process)
    lines = seen.decode().splitlines()
    assert lines[0] == ("chunkline dev stack: warning: stdout cannot be written (No space left on device); "
                        "LiveKit is at ws://127.0.0.1:7880")
    assert lines[-1] == STOPPED and "Traceback" not in seen.decode()


async def test_a_dev_stack_whose_stderr_reader_left_stops_with_143(short_tmp: Path) -> None:
    tmp_path = short_tmp  # the stack's server makes a Unix socket in it: pytest's tmp_path is too long under xdist
    process = await start_dev_stack(tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        await read_until(process.stderr, b"chunkline: serving pipelines/replay")
        await process.stderr.aclose()  # as `| head -1` leaves: every later line meets a broken pipe
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            assert await process.wait() == 143
    finally:
        await end_group(process)


async def test_a_dev_stack_whose_terminal_closed_stops_both_and_leaves_nothing(short_tmp: Path) -> None:
    """SIGHUP, as a closed terminal sends it: the stack died by its default action, leaving LiveKit, the stream
    server and its work folder (the LiveKit secret in its config) behind."""
    tmp_path = short_tmp  # the stack's server makes a Unix socket in it: pytest's tmp_path is too long under xdist
    process = await start_dev_stack(tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        await read_until(process.stderr, b"chunkline: serving pipelines/replay")
        process.send_signal(signal.SIGHUP)
        with trio.fail_after(DEADLINE):
            assert await process.wait() == 129
        seen = await read_until(process.stderr, STOPPED.encode())  # written before it exited
        with pytest.raises(ProcessLookupError):
            os.killpg(process.pid, 0)  # neither LiveKit nor the stream server is left in its group
    finally:
        await end_group(process)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["livekit-server"], "its work folder was left"
    assert "Traceback" not in seen.decode()


async def test_a_dev_stack_whose_livekit_cannot_start_says_so_in_one_line_and_keeps_its_log(short_tmp: Path) -> None:
    """LiveKit exiting at once (its port taken by another): a traceback ending in a RuntimeError, exit 1."""
    tmp_path = short_tmp  # the stack's server makes a Unix socket in it: pytest's tmp_path is too long under xdist
    cannot_bind = "import sys\nprint('bind: address already in use')\nsys.exit(1)\n"
    process = await start_dev_stack(tmp_path, cannot_bind, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with trio.fail_after(DEADLINE):
            assert await process.wait() == 1
        assert process.stderr is not None and process.stdout is not None
        said = (await read_until(process.stderr, STOPPED.encode())).decode()
    finally:
        await end_group(process)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("chunkline-livekit-")]
    assert len(kept) == 1 and (kept[0] / "livekit.log").read_text() == "bind: address already in use\n"
    lines = said.splitlines()
    assert len(lines) == 3
    assert lines[0] == f"chunkline-livekit: the run failed; its config and logs are kept in {kept[0]}"
    # then what its last readiness check met, as it came: "(no answer)", or the refused connection
    assert lines[1].startswith("chunkline dev stack: LiveKit did not start: http://127.0.0.1:7880/: the process exited "
                               "with code 1 (") and lines[2] == STOPPED
    assert await process.stdout.receive_some() == b""

"""A stop signal ends a server whose loop a pipeline holds, naming the code that holds it.

A pipeline call that never awaits (here ``check_options`` sleeping in an ``async def``, ``loop_holding_world.py``)
holds trio's thread, and with it the whole server: its drain, its 55 s bound and a second signal's abort all waited
for that thread. ``chunkline stream-serve`` ignored SIGTERM, a second SIGTERM and SIGINT for as long as the call ran;
under ``hypercorn server:app`` the first signal's drain waited the same, and a SIGTERM to hypercorn's supervisor alone
(``docker stop``, systemd's ``KillMode=mixed``) reached the worker only as a word its held loop never read. Now the
stop looks at the app's loop at once, from a thread: a loop that does not answer within 2 s ends the process with one
line that says where it is held, 128 + the signal (0 for the supervisor's word, as hypercorn's supervisor expects from a
worker it stops).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.room_socket import IDLE_DEADLINE

from .helpers import pid_alive, process_tree

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = "spec_tests/reliability/loop_holding_world.py"
START_DEADLINE = 120.0  # wall seconds: a server process imports torch and loads the pipeline
EXIT_DEADLINE = 20.0  # from the signal to the exit: 2 s of look, against the held call's 120 s
URL = re.compile(rb"(?:Running on|serving \S+ on) (http://127\.0\.0\.1:\d+)")
HELD = (r"pipeline bug: the pipeline \(loop_holding_world\.py, line \d+, in check_options\) has blocked trio's thread "
        r"for at least \d+ s, so the server could not drain its sessions in order \(code that never awaits, .*\): "
        r"exiting now \(exit {status}\)")

CASES = [  # (command, the signal, sent to, the status)
    pytest.param(["-m", "server.cli", "stream-serve", PIPELINE, "--port", "0"], signal.SIGTERM, 143,
                 id="stream-serve-SIGTERM"),
    pytest.param(["-m", "hypercorn", "--bind", "127.0.0.1:0", "server:app"], signal.SIGTERM, 0,
                 id="hypercorn-supervisor-SIGTERM"),
    pytest.param(["-m", "hypercorn", "--worker-class", "trio", "--workers", "0", "--bind", "127.0.0.1:0", "server:app"],
                 signal.SIGINT, 130, id="hypercorn-trio-workers-0-SIGINT"),
]


class Server:
    """The server process, in a session of its own, its stderr kept."""

    def __init__(self, args: list[str], pipeline: str = PIPELINE) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
        env.update(CHUNKLINE_PIPELINE=pipeline, CHUNKLINE_SKIP_VALIDATION="true",
                   PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        self.popen = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.log = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.log.extend(line)

    def until(self, found: re.Pattern[bytes], deadline: float) -> re.Match[bytes]:
        give_up = time.monotonic() + deadline
        while (match := found.search(bytes(self.log))) is None:
            assert self.popen.poll() is None, f"exited {self.popen.returncode}:\n{self.log.decode(errors='replace')}"
            assert time.monotonic() < give_up, f"no {found.pattern!r} in {deadline:g} s:\n{self.log.decode()}"
            time.sleep(0.05)  # bench-cost: real-time poll of another process's log, bounded by a deadline
        return match

    def ready(self) -> str:
        """Its URL, once it says where it serves and its worker has loaded."""
        url = self.until(URL, START_DEADLINE).group(1).decode()
        give_up = time.monotonic() + START_DEADLINE
        while httpx.get(f"{url}/v1/service/ready", timeout=10).status_code != 200:
            assert time.monotonic() < give_up, self.log.decode()
            time.sleep(0.1)  # bench-cost: real-time poll of another process until its worker loaded
        return url

    def end(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self._reader.join(10.0)
        assert self.popen.stderr is not None
        self.popen.stderr.close()


def hold_the_loop(url: str) -> None:
    """A create whose options the pipeline's check holds the loop on (its answer never comes before the end)."""
    try:
        httpx.post(f"{url}/v1/stream/sessions", json={"identity": "c", "config": {"hold": True}}, timeout=60)
    except httpx.HTTPError:
        pass  # the server ended under it, as it should


@pytest.mark.parametrize(("args", "signum", "status"), CASES)
def test_a_stop_signal_ends_a_server_whose_loop_a_pipeline_holds_naming_the_code(
    args: list[str], signum: signal.Signals, status: int
) -> None:
    server = Server(args)
    try:
        url = server.ready()
        tree = process_tree(server.popen.pid)
        threading.Thread(target=hold_the_loop, args=(url,), daemon=True).start()
        server.until(re.compile(rb"holding the loop\n"), 30.0)
        os.kill(server.popen.pid, signum)
        signalled = time.monotonic()
        try:
            code = server.popen.wait(EXIT_DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {EXIT_DEADLINE:g} s after the signal:\n{server.log.decode()}")
        took = time.monotonic() - signalled
        log = server.log.decode(errors="replace")
        assert code == status, log
        assert re.search(HELD.format(status=status), log), log
        assert took < 10.0, f"{took:.1f} s:\n{log}"
        give_up = time.monotonic() + 5.0
        while any(pid_alive(pid) for pid in tree):
            assert time.monotonic() < give_up, f"left running: {[pid for pid in tree if pid_alive(pid)]}\n{log}"
            time.sleep(0.05)  # bench-cost: real-time poll for the server's processes to be gone
    finally:
        server.end()


PAST_THE_FRONT = IDLE_DEADLINE + 3  # seconds a create's check holds the loop: past the front's answer deadline
HELD_FOR = 8  # seconds the pipeline holds the loop: past the warning's 5 s, well within the test's deadlines
WARNED = (r"WARNING .*pipeline bug: trio's thread has been held for at least [5-7] s by loop_holding_world\.py, line \d+, in "
          r"check_options; the server answers nothing meanwhile, health included \(code that never awaits, .*\)")
FREED = r"WARNING .*trio's thread is free again, after [6-8]-(?:[89]|10) s held \(last seen in loop_holding_world\.py, line \d+, in check_options\)"


@pytest.mark.parametrize("args", [CASES[0].values[0], CASES[2].values[0]], ids=["stream-serve", "hypercorn-trio"])
def test_a_loop_held_without_a_stop_is_logged_naming_the_code_and_again_once_free(args: list[str]) -> None:
    """A held server answers nothing, health included; it logged nothing either, so an operator saw a hung server
    and no reason. Now the loop is looked at once a second: held 5 s, a warning names the code; free, a line says so."""
    server = Server(args)
    try:
        url = server.ready()
        answered: list[int] = []

        def create() -> None:
            answered.append(httpx.post(f"{url}/v1/stream/sessions", json={"identity": "c", "config": {"hold": HELD_FOR}},
                                       timeout=60).status_code)

        creating = threading.Thread(target=create, daemon=True)
        creating.start()
        server.until(re.compile(rb"holding the loop\n"), 30.0)
        warned = server.until(re.compile(WARNED.encode()), 20.0)
        server.until(re.compile(FREED.encode()), 20.0)
        creating.join(30.0)
        assert answered == [200], server.log.decode(errors="replace")  # the session made, once the check returned
        log = server.log.decode(errors="replace")
        assert len(re.findall(r"has been held for", log)) == 1, log  # one warning for an 8 s hold (then one a minute)
        assert httpx.get(f"{url}/v1/service/health", timeout=10).status_code == 200, log  # it serves on
        assert warned.start() < log.index("is free again"), log
    finally:
        server.end()


def test_a_create_held_past_the_fronts_deadline_is_answered_with_its_session_not_504() -> None:
    """The front's 30 s answer deadline ran on the loop the pipeline held: it fired once the loop was back, and the
    create was answered ``504 answer_timeout`` while its handler, running on, made the session (a slot held by a
    session whose token no client had). The hold is not counted (:mod:`server.loop_holds`)."""
    server = Server(CASES[0].values[0])
    try:
        url = server.ready()
        answer = httpx.post(f"{url}/v1/stream/sessions", json={"identity": "c", "config": {"hold": PAST_THE_FRONT}},
                            timeout=PAST_THE_FRONT + 30)
        log = server.log.decode(errors="replace")
        assert answer.status_code == 200 and answer.json()["token"], (answer.status_code, answer.text, log)
        assert "not answered within" not in log, log
    finally:
        server.end()

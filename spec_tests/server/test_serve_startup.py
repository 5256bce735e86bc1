"""``chunkline stream-serve`` on a port it cannot have, given an agents' option where no agent runs, or a placement of
too many worker processes: one line naming the options, exit 2, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from server.settings import ServerSettings

from ..processes import end_popen

ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE = 120.0  # wall seconds for the command to import and give up


@pytest.mark.parametrize("where", ["port_in_use", "address_not_here", "cluster_port_in_use"])
def test_a_port_it_cannot_listen_on_exits_2_naming_host_and_port(where: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        host = "192.0.2.1" if where == "address_not_here" else "127.0.0.1"  # TEST-NET-1: never this host's
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
        env["TMPDIR"] = str(tmp_path)  # where the server would put anything of its own
        env["CHUNKLINE_CLUSTER_TOKEN"] = "startup-test-token-0123456789"
        command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--host", host]
        if where == "cluster_port_in_use":
            command += ["--port", "0", "--workers", "external", "--cluster-port", str(port)]
            options = "--cluster-host/--cluster-port"
        else:
            command += ["--port", str(port)]
            options = "--host/--port"
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_DEADLINE)
    assert done.returncode == 2, done.stderr[-2000:]
    why = "Cannot assign requested address" if where == "address_not_here" else "Address already in use"
    line = f"chunkline stream-serve: error: {options}: cannot listen on {host}:{port}: {why}"
    assert done.stderr.strip().splitlines()[-1] == line, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("option", "value"), [
    ("--cluster-port", "7700"), ("--public-url", "http://10.0.0.5:8088"), ("--cluster-host", "0.0.0.0"),
    ("--cluster-token", "a-cluster-token-of-16+"), ("--heartbeat-interval", "2.0"), ("--heartbeat-deadline", "30.0"),
])
def test_an_agents_option_with_in_process_workers_exits_2_naming_it(option: str, value: str, tmp_path: Path) -> None:
    """Every option that only worker agents use (their addresses, token, heartbeats) would do nothing here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env["TMPDIR"] = str(tmp_path)
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--port", "0", option, value]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_DEADLINE)
    assert done.returncode == 2, done.stderr[-2000:]
    shown = "" if option == "--cluster-token" else f" ({value})"  # a secret is never echoed
    line = (f"chunkline stream-serve: error: {option}{shown} applies to worker agents (--workers local, ray or "
            f"external); with --workers in-process it would be ignored")
    assert done.stderr.strip().splitlines() == [line], done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("option", "value", "shown"), [
    ("--worker-mode", "process", " (process)"), ("--placement", '{"encode": "cpu"}', ' ({"encode": "cpu"})'),
    ("--worker-gpu-map", "3", " (3)"), ("--default-fps", "5", " (5.0)"), ("--skip-validation", None, ""),
    ("--control-idle-timeout", "2", " (2.0)"),
])
def test_an_own_workers_option_with_external_agents_exits_2_naming_it(option: str, value: str | None, shown: str,
                                                                       tmp_path: Path) -> None:
    """How the server's own workers run is nothing to external agents, which take their own (``chunkline worker``'s
    flags): these were taken without a word, even one that names nothing real (a placement of a bogus stage)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env.update(TMPDIR=str(tmp_path), CHUNKLINE_CLUSTER_TOKEN="a-cluster-token-of-16+")
    given = [option] if value is None else [option, value]
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--port", "0",
               "--workers", "external", *given]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_DEADLINE)
    assert done.returncode == 2, done.stderr[-2000:]
    line = (f"chunkline stream-serve: error: {option}{shown} applies to the workers this server starts (--workers "
            f"in-process, local or ray); with --workers external it would be ignored (an external agent takes its "
            f"own: chunkline worker --help)")
    assert done.stderr.strip().splitlines() == [line], done.stderr[-2000:]


@pytest.mark.parametrize("options", [
    ["--livekit-api-key", "a-key"], ["--transport", "local", "--livekit-url", "ws://127.0.0.1:7880"],
    ["--transport", "local", "--livekit-api-secret", "s" * 32],
], ids=["key-alone", "url-with-local", "secret-with-local"])
def test_livekit_options_on_the_local_transport_exit_2_naming_them(options: list[str], tmp_path: Path) -> None:
    """LiveKit's URL and keys given on the command line with the local transport did nothing, without a word;
    exported in the environment they are taken (a shell may export them for another server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env["TMPDIR"] = str(tmp_path)
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--port", "0", *options]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_DEADLINE)
    assert done.returncode == 2, done.stderr[-2000:]
    option = next(o for o in options if o.startswith("--livekit"))
    line = f"chunkline stream-serve: error: {option} applies to --transport livekit; with --transport local it would be ignored"
    assert done.stderr.strip().splitlines() == [line], done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_livekit_keys_exported_in_the_environment_are_taken_with_the_local_transport() -> None:
    settings = ServerSettings.from_sources({"pipeline": "pipelines/replay", "transport": "local"},
                                           {"CHUNKLINE_LIVEKIT_API_KEY": "a-key", "CHUNKLINE_LIVEKIT_URL": "ws://127.0.0.1:7880"})
    assert settings.transport == "local"


def test_a_temporary_directory_too_long_for_the_fronts_socket_exits_2_naming_tmpdir(tmp_path: Path) -> None:
    """hypercorn's socket is a file in the server's folder under TMPDIR; a Unix socket's path has at most 107 bytes."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    env["TMPDIR"] = str(deep)
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--port", "0"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=START_DEADLINE)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"chunkline stream-serve: error: TMPDIR: cannot make the front's Unix socket {deep}/"), last
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert list(deep.iterdir()) == []


@pytest.mark.parametrize("api_key", [None, "an-api-key"], ids=["open", "keyed"])
def test_listening_beyond_this_host_without_an_api_key_is_warned_about(api_key: str | None) -> None:
    """Without --api-key every route is open: harmless on the default 127.0.0.1, not on --host 0.0.0.0, where one
    request could drain the only worker for good. The server says so as it starts (no traffic leaves this host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")}
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/replay", "--host", "0.0.0.0", "--port", "0"]
    command += [] if api_key is None else ["--api-key", api_key]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        lines = []
        for line in process.stderr:  # ends at EOF: a failed start is seen, not waited for
            lines.append(line)
            if "chunkline: serving" in line:
                break
        process.send_signal(signal.SIGTERM)
        deadline = threading.Timer(START_DEADLINE, process.kill)  # bounds the read below: EOF comes at the exit
        deadline.start()
        try:
            rest = process.stderr.read()  # the same reader: communicate() would skip what it has buffered
        finally:
            deadline.cancel()
        process.wait(timeout=START_DEADLINE)
    finally:
        end_popen(process)
    log = "".join(lines) + rest
    # 0 once the pipeline was up; 143 while it still loaded (the load is abandoned: test_signals_while_loading.py)
    assert process.returncode in (0, 128 + signal.SIGTERM), log[-2000:]
    warned = "warning: no --api-key, and the server listens beyond this host" in log
    assert warned == (api_key is None), log[-2000:]


@pytest.mark.parametrize(("placement", "words"), [
    ({"encode": ["cpu"] * 500, "denoise": ["cpu"], "decode": ["cpu"]},
     "stage 'encode' asks for 500 ranks (one worker process each); a stage has at most 16"),
    ({"encode": ["cpu"] * 12, "denoise": ["cpu"] * 12, "decode": ["cpu"] * 12},
     "the stages ask for 36 ranks in all ('encode' 12, 'denoise' 12, 'decode' 12); a placement has at most 32"),
], ids=["one-stage", "in-all"])
@pytest.mark.parametrize("given", ["inline", "file"])
def test_a_placement_of_too_many_worker_processes_exits_2_naming_it_before_serving(
        placement: dict[str, list[str]], words: str, given: str, tmp_path: Path) -> None:
    """A placement of 500 ``"cpu"`` ranks was served: the worker spawned 500 processes that import torch, and the
    host ran out of memory. It is refused as the settings are read, before any pipeline loads."""
    text = json.dumps({"mode": "process", **{stage: {"devices": devices} for stage, devices in placement.items()}})
    if given == "file":
        (tmp_path / "placement.json").write_text(text)
        text = str(tmp_path / "placement.json")
    (tmp_path / "tmp").mkdir()
    line = refused_placement(text, TMPDIR=str(tmp_path / "tmp"))
    assert line.startswith(f"chunkline stream-serve: error: --placement: {words}"), line
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize(("text", "words"), [
    ("[]", "inline placement JSON must be an object, got list"),
    ("5", "inline placement JSON must be an object, got int"),
    ("{bad", "inline placement JSON is not valid JSON (Expecting property name"),
    ("file:{bad", "placement file '{file}' is not valid JSON (Expecting property name"),
], ids=["list", "number", "inline-syntax", "file-syntax"])
def test_a_placement_that_is_no_json_object_exits_2_naming_it_before_serving(
        text: str, words: str, tmp_path: Path) -> None:
    """``--placement '[]'`` was told ``is not an existing file``; and ``'{bad'`` (or a file of it) was served: the
    worker refused it for good as it loaded, and the server could never serve, exit 0 on its stop. ``chunkline run``
    refused both as bad input already."""
    if text.startswith("file:"):
        (tmp_path / "placement.json").write_text(text.removeprefix("file:"))
        text = str(tmp_path / "placement.json")
        words = words.format(file=text)
    line = refused_placement(text)
    assert line.startswith(f"chunkline stream-serve: error: --placement: {words}"), line


def refused_placement(placement: str, **env: str) -> str:
    """The one line ``chunkline stream-serve --placement placement`` exits 2 with (the test fails otherwise)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKLINE_")} | env
    command = [sys.executable, "-m", "server.cli", "stream-serve", "pipelines/toy_world", "--port", "0",
               "--placement", placement]
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=START_DEADLINE)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    return line

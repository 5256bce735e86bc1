"""``chunkline stream-serve`` leaves nothing in the temporary directory, however it ends, and only its own
user can reach hypercorn behind the front.

Each test runs the real command with ``TMPDIR`` set to a folder of its own, uploads a reference image, ends
the server, and reads the folder. The server keeps two folders there (``chunkline-front-<pid>-*``, holding
hypercorn's socket, and ``chunkline-uploads-<pid>-*``), both mode 0700 and the server's user's: the socket was
in the abstract namespace, which has no permissions, so any local process of any user could connect to
hypercorn and skip every bound of the front. Both go on SIGTERM and on a second signal during the drain (which
ends the process at once); what a SIGKILL leaves is removed by the next server as it starts, and a server
running beside it keeps its own. A port it cannot listen on is test_serve_startup's.
"""

from __future__ import annotations

import signal
import socket
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from .served_process import DRAINING
from .served_process import stream_serve as serve_pipeline

#: a replay that takes an image: the replay pipeline refuses a create with one (it takes none)
IMAGE_REPLAY = "spec_tests/server/image_replay.py"


def stream_serve(tmp: Path) -> Any:
    """The server of a pipeline that takes the uploaded image each test sends."""
    return serve_pipeline(tmp, pipeline=IMAGE_REPLAY)


def left_in(tmp: Path) -> list[str]:
    return sorted(path.name for path in tmp.iterdir())


def folders_of(tmp: Path, pid: int) -> list[str]:
    """The kinds of the folders server ``pid`` keeps in ``tmp`` (``chunkline-<kind>-<pid>-*``)."""
    return sorted(kind for _, kind, owner, *_ in (name.split("-") for name in left_in(tmp)) if owner == str(pid))


def abstract_sockets() -> list[str]:
    """The abstract-namespace sockets named for chunkline (hypercorn's, before its socket had a folder)."""
    with open("/proc/net/unix") as table:
        return [line.split()[-1] for line in table if "@chunkline" in line]


def uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("Uid:")).split()[1])


async def test_hypercorns_socket_is_in_a_folder_only_the_servers_user_may_enter_and_sigterm_leaves_nothing(
    short_tmp: Path,
) -> None:
    async with stream_serve(short_tmp) as served:
        await served.upload()
        pid = served.process.pid
        assert folders_of(short_tmp, pid) == ["front", "uploads"], left_in(short_tmp)
        for folder in short_tmp.iterdir():
            info = folder.stat()
            assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == uid_of(pid), (folder, oct(info.st_mode))
        (front,) = short_tmp.glob(f"chunkline-front-{pid}-*")
        assert [path.name for path in front.iterdir()] == ["http.sock"]
        assert stat.S_ISSOCK((front / "http.sock").stat().st_mode)
        with socket.socket(socket.AF_UNIX) as direct:  # the user's own processes still reach it (it is listening)
            direct.connect(str(front / "http.sock"))
        assert not [name for name in abstract_sockets() if f"-{pid}-" in name]
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
    assert left_in(short_tmp) == []


@pytest.mark.parametrize(("first", "second"), [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM),
                                               (signal.SIGTERM, signal.SIGINT)])
async def test_a_second_signal_during_the_shutdown_exits_at_once_and_leaves_nothing(
    short_tmp: Path, first: signal.Signals, second: signal.Signals
) -> None:
    """Once the sessions are drained, open connections have a grace before the server exits; a second signal then
    ends it at once, and its line says so (it said "during the drain", which was over)."""
    async with stream_serve(short_tmp) as served:
        await served.upload()
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)):  # an idle connection: the exit waits for it
            served.process.send_signal(first)
            await served.read_until(DRAINING)
            await served.read_until(b"shutdown complete")  # the drain is over; the connection holds the grace
            served.process.send_signal(second)
            assert await served.exit_code() == 128 + first, served.text()
        await served.read_until(b"during the connections' grace, after the drain: exiting now")
    assert left_in(short_tmp) == []


async def test_sighup_drains_the_server_as_sigterm_does_and_leaves_nothing(short_tmp: Path) -> None:
    """A closed terminal (SIGHUP) ended the server by the default action (exit -1), leaving its folders behind.
    (A server started with SIGHUP ignored, as under nohup, keeps ignoring it: the test's own is not passed on.)"""
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        async with stream_serve(short_tmp) as served:
            signal.signal(signal.SIGHUP, inherited)
            await served.upload()
            served.process.send_signal(signal.SIGHUP)
            await served.read_until(DRAINING)
            assert await served.exit_code() == 0, served.text()
    finally:
        signal.signal(signal.SIGHUP, inherited)
    assert left_in(short_tmp) == []


async def test_the_folders_a_killed_server_left_go_as_the_next_server_starts(short_tmp: Path) -> None:
    async with stream_serve(short_tmp) as killed:
        await killed.upload()
        killed.process.kill()
        assert await killed.exit_code() == -signal.SIGKILL
    assert folders_of(short_tmp, killed.process.pid) == ["front", "uploads"], left_in(short_tmp)
    async with stream_serve(short_tmp) as served:
        assert folders_of(short_tmp, killed.process.pid) == [], left_in(short_tmp)  # gone before it served
        assert folders_of(short_tmp, served.process.pid) == ["front"], left_in(short_tmp)
        await served.upload()
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
    assert left_in(short_tmp) == []


async def test_a_server_starting_beside_a_running_one_leaves_that_ones_folders_alone(short_tmp: Path) -> None:
    async with stream_serve(short_tmp) as first:
        await first.upload()
        async with stream_serve(short_tmp) as second:
            await second.upload()
            assert folders_of(short_tmp, first.process.pid) == ["front", "uploads"], left_in(short_tmp)
            assert folders_of(short_tmp, second.process.pid) == ["front", "uploads"], left_in(short_tmp)
            async with httpx.AsyncClient(base_url=first.url, timeout=10) as client:  # its front still reaches hypercorn
                assert (await client.get("/v1/stream/sessions")).json()["sessions"][0]["status"] != "failed"
            second.process.send_signal(signal.SIGTERM)
            assert await second.exit_code() == 0, second.text()
        assert folders_of(short_tmp, first.process.pid) == ["front", "uploads"], left_in(short_tmp)
        first.process.send_signal(signal.SIGTERM)
        assert await first.exit_code() == 0, first.text()
    assert left_in(short_tmp) == []

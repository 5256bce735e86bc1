"""What a client can make the server host's kernel hold for it is bounded: every connection's send buffer is fixed.

Left to itself Linux grows a socket's send buffer with its congestion window, up to ``net.ipv4.tcp_wmem``'s maximum
(4 MiB by default, and at once on loopback); a client that read fast, then went silent (stopped acknowledging), left
all the server had sent it and not yet seen acknowledged in the server's kernel, outside every bound of the server's
own: measured in a private network namespace (a 40 Mbit/s link with a 1 s queue, four viewers of a 1080p60 stream
reading fast for 12 s, then the link cut), 0.95-1.18 MB per socket with the send buffer grown to 4 MiB. Now the
front fixes every accepted connection's ``SO_SNDBUF`` at ``SEND_BUFFER_BYTES`` (the kernel doubles it for its
bookkeeping): at most 512 KiB and one packet more (390-547 KB measured there), with the same throughput.

Here a real server (the front, real loopback sockets) serves frozen viewers that read fast, then stop reading (a small
receive buffer, so their window closes at once), an honest viewer that reads throughout, and an HTTP connection; the
kernel's figures for the server's side of each are read as a user can, with ``ss`` and ``/proc/net/tcp``: each
socket's send buffer (``tb``) and its queue stay within the bound, and the honest viewer is sent every message and
frame. Without the fix the buffers were the kernel's 3.9-4 MiB and the test failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess

import attrs
import pytest
import trio
from wsproto import WSConnection
from wsproto.events import BytesMessage, TextMessage

from server.front import SEND_BUFFER_BYTES

from .test_hostile_server import FAST, WAIT, Server, handshake, running, wait_for



@pytest.fixture(autouse=True)
def needs_ss() -> None:
    """The kernel's figures come from ``ss`` (iproute2, which the LiveKit tests' namespaces need too): CI has it."""
    if shutil.which("ss") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: ss (iproute2) is needed to read the kernel's socket figures")
        pytest.skip("ss (iproute2) is not installed")

PATIENT = attrs.evolve(FAST, write=600.0, ping_interval=300.0, pong=600.0, idle=600.0)
#: the kernel doubles SO_SNDBUF for its bookkeeping; one write may take one packet (64 KiB on loopback) past it
BOUND = 2 * SEND_BUFFER_BYTES + 65536
CONFIG = {"width": 640, "height": 360, "fps": 30, "duration_seconds": 600, "frames_per_chunk": 4}
FROZEN = 3
FAST_READ = 1 << 20  # bytes each frozen viewer reads before it freezes
CHATS = 40  # data messages the controller sends once the viewers froze
SKMEM = re.compile(r"skmem:\(.*?\btb(\d+),")


def server_side(port: int) -> dict[int, tuple[int, int]]:
    """Each established connection of the server's ``port``: client port -> (its send buffer, its send queue)."""
    listing = subprocess.run(["ss", "-tmnH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                             text=True, check=True, timeout=WAIT).stdout
    found: dict[int, tuple[int, int]] = {}
    peer = queued = 0
    for line in listing.splitlines():
        if match := SKMEM.search(line):
            found[peer] = (int(match.group(1)), queued)
        elif fields := line.split():
            queued, peer = int(fields[1]), int(fields[-1].rsplit(":", 1)[1])  # Recv-Q Send-Q local peer
    return found


def tx_queues(port: int) -> dict[int, int]:
    """/proc/net/tcp's tx_queue (bytes sent and not acknowledged, or not sent yet) of the server's connections."""
    queues: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    queues[int(fields[2].rsplit(":", 1)[1], 16)] = int(fields[4].split(":")[0], 16)
    return queues


class Viewer:
    """A room client over a real socket: what it read, in bytes, frames and chat messages."""

    def __init__(self, stream: trio.SocketStream, ws: WSConnection) -> None:
        self.stream, self.ws = stream, ws
        self.port = stream.socket.getsockname()[1]
        self.read_bytes = self.frames = 0
        self.chats: list[object] = []

    async def read(self, until: int | None = None) -> None:
        """Read all that comes (``until``: stop, frozen, once that many bytes came)."""
        while until is None or self.read_bytes < until:
            data = await self.stream.receive_some(1 << 16)
            if not data:
                return
            self.read_bytes += len(data)
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, BytesMessage) and event.message_finished and bytes(event.data[:1]) == b"V":
                    self.frames += 1
                elif isinstance(event, TextMessage) and (message := json.loads(event.data)).get("topic") == "chat":
                    self.chats.append(message["payload"])


async def join(server: Server, created: dict, identity: str, rcvbuf: int | None = None) -> Viewer:
    token = (await server.request("POST", f"/v1/stream/sessions/{created['session_id']}/tokens",
                                  {"identity": identity}))[1]["token"]
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # a frozen reader's window closes at once
    await trio.to_thread.run_sync(sock.connect, (server.host, server.port))
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    return Viewer(stream, await handshake(stream, f"{created['websocket_path']}?token={token}"))


async def test_the_kernel_holds_at_most_the_send_buffer_for_each_connection_and_honest_viewers_get_everything() -> None:
    async with running(deadlines=PATIENT, controller_timeout=3600) as server:
        status, created = await server.request("POST", "/v1/stream/sessions", {"identity": "ctl", "config": CONFIG})
        assert status == 200, created
        ctl_stream = await server.raw()
        ctl_ws = await handshake(ctl_stream, f"{created['websocket_path']}?token={created['token']}")
        frozen = [await join(server, created, f"frozen{i}", rcvbuf=65536) for i in range(FROZEN)]
        honest = await join(server, created, "honest")
        http = await server.raw()  # an HTTP keep-alive connection, answered once
        await http.send_all(b"GET /v1/service/health HTTP/1.1\r\nHost: x\r\n\r\n")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Viewer(ctl_stream, ctl_ws).read)
            nursery.start_soon(honest.read)
            nursery.start_soon(http.receive_some, 65536)
            with trio.fail_after(WAIT * 3):
                async with trio.open_nursery() as reading:
                    for viewer in frozen:
                        reading.start_soon(viewer.read, FAST_READ)  # then it reads no more

            async def windows_closed() -> bool:  # the server's kernel holds data none of them reads
                queues = tx_queues(server.port)
                return all(queues.get(viewer.port, 0) > 0 for viewer in frozen)

            await wait_for(windows_closed, "the frozen viewers' windows to close")
            frames = honest.frames
            for number in range(CHATS):
                chat = json.dumps({"topic": "chat", "payload": str(number)})
                await ctl_stream.send_all(ctl_ws.send(TextMessage(chat)))

            async def honest_has_all() -> bool:
                return len(honest.chats) == CHATS and honest.frames >= frames + 2 * CONFIG["fps"]

            await wait_for(honest_has_all, "the honest viewer to get every chat message and two seconds of frames")
            buffers = server_side(server.port)
            queues = tx_queues(server.port)
            nursery.cancel_scope.cancel()
        assert honest.chats == list(range(CHATS))
        assert len(buffers) >= FROZEN + 3, buffers  # the frozen viewers, the honest one, the controller, HTTP
        too_large = {port: figures for port, figures in buffers.items() if figures[0] > 2 * SEND_BUFFER_BYTES}
        assert not too_large, f"the kernel's send buffers grew past {2 * SEND_BUFFER_BYTES} bytes: {too_large}"
        for viewer in frozen:
            assert 0 < queues[viewer.port] <= BOUND, (viewer.port, queues)
        for stream in (http, honest.stream, ctl_stream, *(viewer.stream for viewer in frozen)):
            await stream.aclose()


async def test_the_send_buffer_is_a_setting() -> None:
    """``--socket-send-buffer``: a larger stream over a longer link may be given more (the kernel doubles it)."""
    async with running(socket_send_buffer=1024 * 1024) as server:
        http = await server.raw()
        await http.send_all(b"GET /v1/service/health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await http.receive_some(65536)
        figures = server_side(server.port)[http.socket.getsockname()[1]]
        with open("/proc/sys/net/core/wmem_max") as most:  # the kernel caps SO_SNDBUF there (212992 when stock)
            assert figures[0] == 2 * min(1024 * 1024, int(most.read())), figures
        await http.aclose()

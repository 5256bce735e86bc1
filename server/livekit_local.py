"""A real LiveKit server on this machine: its config, its process, and a private network for WebRTC.

``make livekit-server`` builds the pinned release from its Go module into ``.tools/livekit-server``;
this module runs it for the tests, the benchmark and ``make run LIVEKIT=1``:

- :class:`LiveKitConfig` writes the server's YAML: chunkline's own key pair (the built-in dev keys are
  shorter than the 32 bytes chunkline requires), signalling on ``port``, all media on one UDP mux port,
  ICE over TCP off, no TURN, no redis (a single node keeps its rooms in memory), a STUN placeholder on
  the node's own address so no client is ever sent to a public STUN host;
- :func:`running_livekit` (blocking, so a module-scoped fixture can share one server) starts the binary, waits until ``GET /`` answers 200, and stops it at exit
  (SIGTERM, a second SIGTERM, then SIGKILL, each bounded);
- :func:`work_folder` holds a run's config (with its secret) and logs: removed when the run ends, kept
  (and named) only when it fails;
- :class:`PrivateNetwork` is a network namespace with ``lo`` up and one end of a veth pair
  (``10.77.k.1/30``; the other end, ``10.77.k.2``, stays in the caller's namespace, and nothing has a
  route out). libwebrtc gathers no candidates on loopback, so the server and its WebRTC clients run in
  there; the caller still reaches them over the veth pair. Making one needs root.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from .console import is_broken_pipe, tell
from .early_signals import stop_signals

__all__ = [
    "LIVEKIT_VERSION",
    "LiveKitConfig",
    "LiveKitNotBuilt",
    "PrivateNetwork",
    "find_livekit_server",
    "running_livekit",
    "stop_process",
    "work_folder",
]

LIVEKIT_VERSION = "v1.13.5"  # the Makefile's pin
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BINARY = ROOT / ".tools" / "livekit-server"
READY_TIMEOUT = 20.0
DEV_STACK = "chunkline dev stack"  # how the dev stack's own lines begin
STOP_GRACE = 3.0  # per signal; the first SIGTERM waits for participants, the second does not


class LiveKitNotBuilt(RuntimeError):
    """The LiveKit server binary is missing: build it with ``make livekit-server``."""


def find_livekit_server() -> Path:
    """``$CHUNKLINE_LIVEKIT_SERVER`` or ``.tools/livekit-server``; raises :class:`LiveKitNotBuilt` without it."""
    path = Path(os.environ.get("CHUNKLINE_LIVEKIT_SERVER") or DEFAULT_BINARY)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LiveKitNotBuilt(f"no LiveKit server at {path}: run `make livekit-server` (needs Go)")
    return path


def _secret() -> str:
    return secrets.token_urlsafe(36)  # 48 characters, more than the 32 bytes chunkline requires


@attrs.frozen
class LiveKitConfig:
    """One LiveKit server: where it listens and advertises, and its key pair."""

    bind: str
    node_ip: str
    port: int = 7880
    udp_port: int = 7882
    tcp_port: int = 0  # 0: no ICE over TCP
    api_key: str = attrs.field(factory=lambda: "chunkline-" + secrets.token_hex(4))
    api_secret: str = attrs.field(factory=_secret)
    log_level: str = "info"

    @property
    def url(self) -> str:
        return f"ws://{self.bind}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.bind}:{self.port}"

    def yaml(self) -> str:
        """The config file (YAML; JSON-style values, which YAML reads as they are)."""
        return "\n".join(
            [
                f"port: {self.port}",
                f'bind_addresses: ["{self.bind}"]',
                "keys:",
                f'  "{self.api_key}": "{self.api_secret}"',
                "rtc:",
                f"  udp_port: {self.udp_port}",
                f"  tcp_port: {self.tcp_port}",
                "  use_external_ip: false",
                f"  node_ip: {self.node_ip}",
                "  enable_loopback_candidate: false",
                "  ips:",
                f'    includes: ["{self.node_ip}/32"]',
                f'  stun_servers: ["{self.node_ip}:3478"]',  # nothing listens there: no public STUN host
                "turn:",
                "  enabled: false",
                # rooms are made by the server as it creates a session (the RoomService), never by a join: the
                # token of an ended session, whose room was deleted, opens nothing
                "room:",
                "  auto_create: false",
                "logging:",
                f"  level: {self.log_level}",
                "  pion_level: error",
                "",
            ]
        )


def stop_process(process: subprocess.Popen[Any], *, signals: Sequence[int] = (signal.SIGTERM,), grace: float = STOP_GRACE) -> None:
    """Send each of ``signals`` in turn, waiting ``grace`` s after each, then SIGKILL; returns once it is reaped."""
    for sig in signals:
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()


def wait_http_ok(url: str, timeout: float, process: subprocess.Popen[Any] | None = None) -> None:
    """Poll ``url`` until it answers 200; fail (naming the last answer) after ``timeout`` or if ``process`` exits."""
    last = "no answer"
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{url}: the process exited with code {process.returncode} ({last})")
            try:
                response = client.get(url)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)  # bench-cost: a real process starting up; bounded by the deadline
    raise RuntimeError(f"{url} did not answer 200 within {timeout:g} s ({last})")


@contextlib.contextmanager
def work_folder(prefix: str) -> Iterator[Path]:
    """A private temporary folder for a run's config and logs, removed at exit unless the run raised (then it is
    kept for its logs and named on stderr; Ctrl-C is no failure)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    except Exception:
        tell(f"{prefix.rstrip('-')}: the run failed; its config and logs are kept in {folder}")
        raise
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def running_livekit(
    config: LiveKitConfig, workdir: Path, *, prefix: Sequence[str] = (), binary: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """The LiveKit server, ready (``GET /`` is 200), until exit; its log is ``workdir/livekit.log``."""
    binary = binary or find_livekit_server()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "livekit.yaml"
    config_path.write_text(config.yaml())
    config_path.chmod(0o600)
    with open(workdir / "livekit.log", "wb") as log:
        process = subprocess.Popen([*prefix, str(binary), "--config", str(config_path)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_http_ok(config.http_url + "/", READY_TIMEOUT, process)
            yield process
        finally:
            stop_process(process, signals=(signal.SIGTERM, signal.SIGTERM))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@attrs.define
class PrivateNetwork:
    """A network namespace with one veth address of its own, reachable from outside over the pair only."""

    name: str
    index: int

    @property
    def inner_ip(self) -> str:
        """The namespace's own address (servers bind here)."""
        return f"10.77.{self.index}.1"

    @property
    def outer_ip(self) -> str:
        """The caller's end of the veth pair."""
        return f"10.77.{self.index}.2"

    @property
    def outer_link(self) -> str:
        return f"lkc{self.index}"

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    @classmethod
    def create(cls, label: str = "chunkline-lk") -> PrivateNetwork:
        """Make the namespace and a free veth pair (``lkc<k>`` outside, ``lkn<k>`` inside); needs root."""
        remove_stale_networks(label)
        name = f"{label}-{os.getpid()}-{secrets.token_hex(3)}"
        _ip("netns", "add", name)
        try:
            start = random.randrange(256)
            for step in range(256):
                index = (start + step) % 256
                try:  # the kernel refuses a taken link name: that is the allocation
                    _ip("link", "add", f"lkc{index}", "type", "veth", "peer", "name", f"lkn{index}", "netns", name)
                except subprocess.CalledProcessError:
                    continue
                network = cls(name, index)
                inside = ["netns", "exec", name, "ip"]
                _ip(*inside, "addr", "add", f"{network.inner_ip}/30", "dev", f"lkn{index}")
                _ip(*inside, "link", "set", f"lkn{index}", "up")
                _ip(*inside, "link", "set", "lo", "up")
                _ip("addr", "add", f"{network.outer_ip}/30", "dev", network.outer_link)
                _ip("link", "set", network.outer_link, "up")
                return network
            raise RuntimeError("no free veth name lkc0..lkc255")
        except BaseException:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            raise

    def pids(self) -> list[int]:
        """Processes still inside the namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=10).stdout
        return [int(pid) for pid in out.split()]

    def destroy(self) -> list[int]:
        """Kill what is left inside (returned: it should be nothing), then remove the pair and the namespace."""
        left = self.pids()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "link", "del", self.outer_link], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
        return left


def remove_stale_networks(label: str) -> list[str]:
    """Remove the empty namespaces ``label-<pid>-<hex>`` whose maker is dead (a run killed before its
    cleanup), so that killed runs do not pile up namespaces and veth names; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    removed = []
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        maker = name.removeprefix(f"{label}-").split("-", 1)[0]
        if not name.startswith(f"{label}-") or not maker.isdigit() or Path(f"/proc/{maker}").exists():
            continue
        if PrivateNetwork(name, 0).pids():
            continue  # something still runs inside: not ours to remove
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        removed.append(name)
    return removed


def livekit_settings_env(config: LiveKitConfig) -> dict[str, Any]:
    """The ``CHUNKLINE_LIVEKIT_*`` variables that point a stream server at ``config``'s server."""
    return {
        "CHUNKLINE_LIVEKIT_URL": config.url,
        "CHUNKLINE_LIVEKIT_API_KEY": config.api_key,
        "CHUNKLINE_LIVEKIT_API_SECRET": config.api_secret,
    }


# -- the one-command dev stack: `make run LIVEKIT=1` ----------------------------------------------------


def machine_address() -> str:
    """This machine's first non-loopback IPv4 address (WebRTC gathers no candidates on loopback)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    raise RuntimeError("no non-loopback IPv4 address: WebRTC needs one (LiveKit advertises it to browsers)")


def dev_stack(argv: Sequence[str]) -> int:
    """LiveKit (generated keys, signalling on 127.0.0.1:7880, media on this machine's address) and
    ``chunkline stream-serve ARGV`` pointed at it; Ctrl-C, SIGTERM or SIGHUP stops both. Returns the exit code
    (128 + the stop signal once started). Its own lines go through :func:`server.console.tell`: a stdout or stderr
    closed or gone loses a line, never the stack (a stderr closed put its lines on stdout, and one on a full disk
    or a pipe whose reader left ended it with a traceback's exit 1, the stop line even after a clean Ctrl-C)."""
    try:
        binary = find_livekit_server()
        address = machine_address()
    except (LiveKitNotBuilt, RuntimeError) as exc:
        tell(f"{DEV_STACK}: {exc}")
        return 2
    config = LiveKitConfig(bind="127.0.0.1", node_ip=address, tcp_port=7881)
    env = {**os.environ, **livekit_settings_env(config)}
    chunkline = Path(sys.executable).with_name("chunkline")
    stopped_by = [signal.SIGINT]

    def stop(signum: int, frame: object) -> None:
        """SIGTERM and SIGHUP (its terminal closed) stop both as Ctrl-C does; a SIGHUP killed the stack by its
        default action, and left LiveKit, the stream server and the folder with its secret behind."""
        stopped_by[0] = signal.Signals(signum)
        raise KeyboardInterrupt

    for number in stop_signals():  # a SIGHUP ignored at start (nohup) stays ignored, as for every command
        signal.signal(number, stop)
    try:
        with work_folder("chunkline-livekit-") as workdir, running_livekit(config, workdir, binary=binary):
            unwritten = tell(f"LiveKit {LIVEKIT_VERSION} at {config.url} (media: udp {address}:{config.udp_port}, "
                             f"tcp {config.tcp_port}); log {workdir / 'livekit.log'}", to="stdout")
            if unwritten is not None and not is_broken_pipe(unwritten):
                tell(f"{DEV_STACK}: warning: stdout cannot be written ({unwritten}); LiveKit is at {config.url}")
            server = subprocess.Popen([str(chunkline), "stream-serve", *argv], env=env)
            try:
                return server.wait()
            finally:
                stop_process(server, signals=(signal.SIGINT, signal.SIGTERM), grace=10.0)
    except RuntimeError as exc:  # LiveKit exited or never answered (its port taken...): its log is kept, named above
        tell(f"{DEV_STACK}: LiveKit did not start: {exc}")
        return 1
    except KeyboardInterrupt:
        return 128 + stopped_by[0]  # 130, 143 or 129: how it was stopped, as chunkline run says it
    finally:
        tell("stopped the stream server and LiveKit")


if __name__ == "__main__":
    raise SystemExit(dev_stack(sys.argv[1:]))

"""What a worker agent is told to be (``chunkline worker``'s options) and where its authority is."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import attrs

from .identity import chunkline_version

__all__ = ["AgentOptions", "parse_authority"]


def parse_authority(url: str) -> tuple[str, str, int]:
    """``tcp://host:port`` or ``tls://host:port`` -> (scheme, host, port); ValueError names what is wrong (a password
    in the URL is never repeated)."""
    parts = urlsplit(url)
    shown = repr(url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1))
    if parts.scheme not in ("tcp", "tls"):
        raise ValueError(f"--authority must be tcp://HOST:PORT or tls://HOST:PORT, got {shown}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"--authority {shown} needs a host and a port")
    if port == 0:
        raise ValueError(f"--authority {shown} needs a port 1-65535 (port 0 is no authority's)")
    unused = [what for what, there in (("a user or password", "@" in parts.netloc),
                                       ("a path", parts.path not in ("", "/")), ("a query", bool(parts.query)),
                                       ("a fragment", bool(parts.fragment))) if there]
    if unused:  # dropped without a word, the password written to every log line that names the authority
        raise ValueError(f"--authority {shown} has {' and '.join(unused)}, which the agent cannot use: give "
                         "tcp://HOST:PORT or tls://HOST:PORT (the cluster token is CHUNKLINE_CLUSTER_TOKEN or "
                         "--cluster-token-file; TLS is the tls:// scheme with --tls-ca)")
    return parts.scheme, parts.hostname, port


@attrs.frozen(kw_only=True)
class AgentOptions:
    pipeline: str
    authority: str
    token: str = attrs.field(repr=False)
    devices: tuple[int, ...] = ()
    max_sessions: int | str = "auto"
    worker_mode: str = "in-process"
    placement: str | None = None
    node: str = attrs.Factory(socket.gethostname)
    launcher: str = "external"
    slot: str | None = None
    launcher_pid: int | None = None  # the authority that started this agent: the agent ends with it
    tls_ca: str | None = None
    drain_deadline: float = 30.0
    control_idle_timeout: float = 10.0  # offered to the pipeline, as the authority offers its own workers
    default_fps: float = 16.0
    validate: bool = True  # the startup check, unless the authority runs with --skip-validation
    version: str = attrs.Factory(chunkline_version)

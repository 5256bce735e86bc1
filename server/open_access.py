"""Who may use the API: web pages of other origins may not make a browser change anything here, and an API that
answers beyond this host with no API key is said to be open, once (any client could then drain every worker).

A page elsewhere can make its visitor's browser send a POST without asking this server first (a form, or a
``text/plain`` body: a "simple" request, no preflight), and with no API key that drained the workers; such a
request names its page in ``Origin``, which must be this server itself or one of ``--cors-allow-origins``; with no
API key, "this server itself" also means a name it knows (:func:`own_names`), against DNS rebinding.

``chunkline stream-serve`` knows its listeners and says so as it starts. Under ``hypercorn server:app`` the bind is
hypercorn's, and in some of its modes the sockets are made after the app starts, so the app looks at its first
request: the address it came in on, and the sockets of this process listening on that port.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import socket
from typing import Any
from urllib.parse import urlsplit

from .console import tell
from .reasons import echo

__all__ = ["UNGUARDED", "WarnsOnceIfOpen", "is_loopback", "key_refusal", "listening_hosts", "own_names",
           "page_refusal"]

#: what an open API lets anyone who reaches it do (both warnings end with it)
UNGUARDED = "whoever reaches it may create and delete sessions and drain its workers"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address) is reachable from this host only; a name or a Unix path counts as local."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return True


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _split_host(netloc: str) -> tuple[str, int | None]:
    """``host[:port]`` (a bracketed IPv6 address too) as its lower-cased host and its port, None when not given."""
    try:
        parts = urlsplit(f"//{netloc}")
        return (parts.hostname or ""), parts.port
    except ValueError:  # a port that is not a number, a bracket left open ("[::1"): a name no page is at
        return netloc.lower(), None


def own_names(host: str, public_url: str | None) -> frozenset[str]:
    """The names an open server (no API key) answers pages under: ``localhost``, ``--host`` and ``--public-url``'s
    (an IP address always). A page at a name of its own that the attacker points at this host (DNS rebinding) is
    then the server's own origin to the browser, with its Host header naming it."""
    names = {"localhost", host.lower()}
    if public_url:
        names.add((urlsplit(public_url).hostname or "").lower())
    return frozenset(names)


def page_refusal(origin: str, host: str | None, allowed: tuple[str, ...], names: frozenset[str] | None) -> str | None:
    """Why a browser request from a page at ``origin`` may not change state here, or None: the page must be this
    server's own (same host; same port, or the default port of its scheme where ``Host`` names none) or be named in
    ``allowed`` (``*``: any); with ``names`` (an open server), this server's own name must be one of them."""
    if origin in allowed or "*" in allowed:
        return None
    try:
        page = urlsplit(origin)
    except ValueError:  # "http://[::1": a 500 with a traceback, before the API key was checked
        return f"its Origin {echo(origin)} is not a page's address"
    if page.scheme in _DEFAULT_PORTS and page.netloc and host:
        page_host, page_port = _split_host(page.netloc)
        own_host, own_port = _split_host(host)
        default = _DEFAULT_PORTS[page.scheme]
        # a Host without a port names the default one of the page's scheme (behind a TLS proxy: https, 443)
        if page_host == own_host and (own_port or default) == (page_port or default):
            if names is None or own_host in names or _is_address(own_host):
                return None
            return (f"this server answers pages under its own name only at localhost, an IP address, --host or "
                    f"--public-url while no API key is set, not {echo(own_host)}")
    return "--cors-allow-origins names the pages that may"


def key_refusal(header: str | None, api_key: str) -> str | None:
    """Why a request's ``Authorization`` header does not carry ``api_key`` (compared in constant time), or None.

    The scheme is case-insensitive, and one or more spaces follow it (RFC 9110 11.1, 11.4): both were a 401. The
    words say what was wrong, never what was sent (a key, or a key given as the scheme)."""
    scheme, _, key = (header or "").partition(" ")
    key = key.lstrip(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(key.encode("utf-8", "surrogateescape"), api_key.encode()):
        return None
    if header is None:
        return "no Authorization header"
    if scheme.lower() != "bearer" or not key:
        return "the Authorization header is not 'Bearer <api key>'"
    return "the key sent is not this server's API key (--api-key)"


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def listening_hosts(port: int) -> list[str]:
    """The addresses this process's listening TCP sockets on ``port`` are bound to (read from its open files)."""
    hosts: list[str] = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                fd = int(name)
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and sock.getsockname()[1] == port:
                        hosts.append(sock.getsockname()[0])
    return hosts


class WarnsOnceIfOpen:
    """The app hypercorn serves when no API key is set: at its first request, a warning if it answers beyond this host."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._checked = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not self._checked and scope["type"] in ("http", "websocket"):
            self._checked = True
            warn_if_open(scope.get("server"))
        await self._app(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)


def warn_if_open(server: tuple[str, int | None] | None) -> None:
    """Warn when the request's own address, or a socket listening on its port, is reachable from other hosts."""
    if server is None or server[1] is None:
        return  # a Unix socket: local by nature
    host, port = server
    beyond = sorted({h for h in [host, *listening_hosts(port)] if not is_loopback(h)})
    if beyond:
        where = ", ".join(f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in beyond)
        tell(f"chunkline: warning: no CHUNKLINE_API_KEY, and the server answers beyond this host ({where}): "
             f"{UNGUARDED}")

"""Child process targets for the supervisor tests (run in spawned children; nothing heavy imported)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from engine.supervised_child import bind_to_parent


def echo(conn: Any, config: dict[str, Any]) -> None:
    """Says hello, echoes every message, leaves on b"bye" (or a closed pipe)."""
    bind_to_parent(config)
    conn.send_bytes(config.get("hello", b"hello"))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if data == b"bye":
            return
        conn.send_bytes(data)


def stubborn(conn: Any, config: dict[str, Any]) -> None:
    """Says hello, then ignores its goodbye and SIGTERM: only SIGKILL ends it."""
    bind_to_parent(config)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send_bytes(b"hello")
    threading.Event().wait()


def heartbeat(conn: Any, config: dict[str, Any]) -> None:
    """Says hello, then beats every ``interval`` seconds for ``beats`` beats, then falls silent."""
    bind_to_parent(config)
    conn.send_bytes(b"hello")
    pause = threading.Event()
    for _ in range(config["beats"]):
        pause.wait(config["interval"])
        conn.send_bytes(b"beat")
    pause.wait()


def exits_before_hello(conn: Any, config: dict[str, Any]) -> None:
    bind_to_parent(config)
    os._exit(config.get("code", 4))

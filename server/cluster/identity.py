"""What an agent and the authority compare at registration: chunkline's version and the pipeline's code; and how
an agent is named: its worker id, and the participant it joins its rooms as."""

from __future__ import annotations

import functools
import hashlib
import secrets
from importlib import metadata
from pathlib import Path

__all__ = ["chunkline_version", "pipeline_name", "pipeline_digest", "WORKER_ID_DIGITS", "new_worker_id",
           "worker_participant"]

#: hex digits an agent adds to its ``--node`` for the worker id of each registration
WORKER_ID_DIGITS = 8


def new_worker_id(node: str) -> str:
    """A fresh worker id for an agent on ``node``: ``<node>-<WORKER_ID_DIGITS hex digits>``."""
    return f"{node}-{secrets.token_hex(WORKER_ID_DIGITS // 2)}"


def worker_participant(worker_id: str) -> str:
    """The identity a worker agent joins its sessions' rooms as."""
    return f"chunkline-{worker_id}"


def chunkline_version() -> str:
    try:
        return metadata.version("chunkline")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree without install
        return "0+unknown"


def pipeline_name(pipeline: str) -> str:
    """The pipeline's file or package name (paths differ between hosts; names and code must not)."""
    path = Path(pipeline)
    return path.stem if path.is_file() else path.name


@functools.lru_cache(maxsize=8)
def pipeline_digest(pipeline: str) -> str:
    """SHA-256 over the pipeline's Python sources (a file, or every ``*.py`` of a package, by relative path)."""
    path = Path(pipeline)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
    for file in files:
        digest.update(str(file.relative_to(path if path.is_dir() else path.parent)).encode() + b"\0")
        digest.update(file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]

"""What an agent and the authority compare at registration: chunkline's version and the pipeline's code."""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

__all__ = ["chunkline_version", "pipeline_name", "pipeline_digest"]


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

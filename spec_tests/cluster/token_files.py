"""Token files that cannot hold a cluster token, made for the tests of ``--cluster-token-file`` (the agent's and
the authority's read them through the same rules)."""

from __future__ import annotations

import os
from pathlib import Path


def token_file(tmp_path: Path, kind: str) -> Path:
    """A file of ``kind`` (``pipe``, ``/dev/null``, ``large``, ``latin-1``, ``missing``, ``directory``, ``blank``,
    ``short``) where a token file is expected."""
    path = tmp_path / "token"
    if kind == "pipe":
        os.mkfifo(path)
    elif kind == "/dev/null":
        path = Path("/dev/null")
    elif kind == "large":
        path.write_text("t" * 4097)
    elif kind == "latin-1":
        path.write_bytes("cluster-token-caf\xe9-0123456789".encode("latin-1"))
    elif kind == "directory":
        path.mkdir()
    elif kind == "blank":
        path.write_text(" \n")
    elif kind == "short":
        path.write_text("fifteen-bytes!!\n")
    elif kind != "missing":
        raise ValueError(f"no token file of kind {kind!r}")
    return path

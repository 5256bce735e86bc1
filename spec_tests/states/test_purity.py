"""``states`` stays pure: it imports only the standard library, attrs and itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import states

STATES_DIR = Path(states.__file__).resolve().parent
SOURCES = sorted(STATES_DIR.glob("*.py"))
ALLOWED_THIRD_PARTY = {"attrs", "states"}
FORBIDDEN = {"trio", "torch", "quart", "quart_trio", "livekit", "engine", "server", "pipelines"}


def _imports(tree: ast.AST):
    """(line, top-level module name or None for a relative import) per import."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                yield node.lineno, None
            else:
                yield node.lineno, (node.module or "").partition(".")[0]


def test_sources_found() -> None:
    names = {path.name for path in SOURCES}
    assert {"machine.py", "stream_session.py", "lease.py", "worker.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.name)
def test_imports_are_stdlib_attrs_or_states(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = []
    for lineno, top in _imports(tree):
        if top is None:
            continue
        if top in FORBIDDEN or not (top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY):
            bad.append(f"{path.name}:{lineno}: {top}")
    assert not bad, f"states must import only the standard library, attrs and states: {bad}"

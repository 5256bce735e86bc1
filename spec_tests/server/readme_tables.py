"""Reading the README's reference tables and the code they must name, for the tests that keep the two in step
(``test_readme_reference.py``, ``test_readme_error_codes.py``).

A section is read from its heading to the next heading, and a table by the first cell of its header row; an item
counts as named only in the first column of its own table.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "PIPELINES", "README", "ROOT", "SERVER", "argument", "calls", "cells", "missing", "missing_with_fields", "number",
    "numbers", "parsed", "python_files", "quoted", "row_of", "section", "table", "texts",
]

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


# -- reading the README ------------------------------------------------------------------------------------------


def section(title: str) -> str:
    """The text under the heading ``title`` (any level), up to the next heading of the same level or above."""
    lines = README.splitlines()
    heading = re.compile(r"^(#{1,6}) (.*)$")
    start = level = None
    fenced = False
    for number, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            continue
        found = None if fenced else heading.match(line)
        if found is None:
            continue
        if start is None:
            if found.group(2).strip() == title:
                start, level = number + 1, len(found.group(1))
        elif len(found.group(1)) <= level:  # type: ignore[operator]
            return "\n".join(lines[start:number])
    assert start is not None, f"README.md has no heading {title!r}"
    return "\n".join(lines[start:])


def cells(line: str) -> list[str]:
    """A table row's cells (a ``|`` inside backticks is text, not a border)."""
    out, cell, quoted = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            quoted = not quoted
        if char == "|" and not quoted:
            out.append(cell.strip())
            cell = ""
        else:
            cell += char
    out.append(cell.strip())
    return out


def table(text: str, header: str) -> list[list[str]]:
    """The rows (below the header and its rule) of the table in ``text`` whose header row's first cell is ``header``."""
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line.startswith("|") and cells(line)[0] == header:
            rows = []
            for row in lines[number + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            return rows
    raise AssertionError(f"README.md has no table headed {header!r} in the section")


def quoted(cell: str) -> set[str]:
    """The names a cell gives in backticks; a call's name without its parameters (``create_session(config)``)."""
    return {name.split("(", 1)[0].strip() for name in re.findall(r"`([^`]+)`", cell)}


def row_of(rows: list[list[str]], name: str) -> list[str] | None:
    """The row whose first cell names ``name`` in backticks."""
    return next((row for row in rows if name in quoted(row[0])), None)


def missing(wanted: dict[str, str], rows: list[list[str]]) -> list[str]:
    """``name (where it came from)`` for each wanted name no row's first cell names."""
    return [f"{name} ({where})" for name, where in sorted(wanted.items()) if row_of(rows, name) is None]


def missing_with_fields(found: dict[str, tuple[set[str], str]], rows: list[list[str]]) -> list[str]:
    """:func:`missing` for ``found`` (``{item: (its fields, where it was found)}``), and each field its row does not
    name in its second cell."""
    problems = missing({kind: where for kind, (_, where) in found.items()}, rows)
    for kind, (fields, where) in found.items():
        row = row_of(rows, kind) or ["", ""]
        problems += [f"{kind}.{field} ({where}): not named in its row" for field in fields if field not in quoted(row[1])]
    return problems


# -- reading the code --------------------------------------------------------------------------------------------


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def calls(paths: list[Path], *names: str) -> Iterator[tuple[ast.Call, str]]:
    """Every call of a function or method named one of ``names`` in ``paths``, with ``file:line``."""
    for path in paths:
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in names:
                    yield node, f"{path.relative_to(ROOT)}:{node.lineno}"


def texts(node: ast.AST | None) -> list[str]:
    """The string constants an argument can be (``"a"``, ``"a" if x else "b"``, ``cause or "b"``); none for a name."""
    if node is None:
        return []
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.IfExp):
        return texts(node.body) + texts(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [text for value in node.values for text in texts(value)]
    return []


def number(node: ast.AST | None) -> int | None:
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def numbers(node: ast.AST | None) -> list[int]:
    """The whole numbers an argument can be (``1000 if x else self.code``: 1000)."""
    if isinstance(node, ast.IfExp):
        return numbers(node.body) + numbers(node.orelse)
    return [] if (value := number(node)) is None else [value]


def argument(call: ast.Call, index: int, keyword: str | None = None) -> ast.AST | None:
    if keyword is not None:
        for given in call.keywords:
            if given.arg == keyword:
                return given.value
    return call.args[index] if len(call.args) > index else None


def python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


SERVER = python_files("server")
PIPELINES = python_files("pipelines")

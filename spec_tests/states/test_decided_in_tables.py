"""Every lifecycle decision is a lookup in ``states/``: nothing outside it compares or assigns a state.

Code in ``engine/``, ``server/`` and ``pipelines/`` asks what a state means through a named set or mapping that
its lifecycle module defines beside the table (``state in TAKES_WORK``, ``ON_STOP_SIGNAL[state]``), never by naming
one state (``state is State.FAILED``): a rule written beside the table is where wrong behaviours hid. The check
reads the sources' syntax trees; a name counts as a lifecycle's state enum wherever it came from (a re-export, an
alias, a ``states`` module imported under another name).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import states
from states.machine import StateMachine

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    path for top in ("engine", "server", "pipelines") for path in (ROOT / top).rglob("*.py") if "__pycache__" not in path.parts
)


def _state_enums() -> set[type]:
    """The state enum of every lifecycle table in ``states/`` (the type of each machine's initial state)."""
    found = set()
    for info in pkgutil.iter_modules(states.__path__):
        for value in vars(importlib.import_module(f"states.{info.name}")).values():
            if inspect.isclass(value) and issubclass(value, StateMachine) and getattr(value, "INITIAL", None) is not None:
                found.add(type(value.INITIAL))
    return found


STATE_ENUMS = _state_enums()


def _package_of(path: Path, root: Path) -> str:
    """The package a module belongs to (for its relative imports): ``engine`` for engine/actors.py and engine/__init__.py."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1])


def _imported(path: Path, tree: ast.Module, root: Path) -> tuple[set[str], set[str]]:
    """(local names bound to a state enum, local names bound to a module that defines one)."""
    enums: set[str] = set()
    modules: set[str] = set()
    package = _package_of(path, root) if root in path.parents else ""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        try:
            module = importlib.import_module(base)
        except ImportError:
            continue
        for alias in node.names:
            value = getattr(module, alias.name, None)
            if value is None:
                try:
                    value = importlib.import_module(f"{base}.{alias.name}")
                except ImportError:
                    continue
            if inspect.isclass(value) and value in STATE_ENUMS:
                enums.add(alias.asname or alias.name)
            elif inspect.ismodule(value) and any(inspect.isclass(kind) and kind in STATE_ENUMS for kind in vars(value).values()):
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):  # ``ActorState = actor_table.State``
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id in modules:
                enums.add(node.targets[0].id)
    return enums, modules


def _names_a_state(node: ast.AST, enums: set[str], modules: set[str]) -> bool:
    """``State.X``, ``alias.X`` or ``module.State.X``."""
    if not isinstance(node, ast.Attribute) or not node.attr.isupper():
        return False
    owner = node.value
    if isinstance(owner, ast.Name):
        return owner.id in enums
    return isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id in modules


def decisions_outside_tables(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line: code`` for each comparison with, or assignment of, one named state in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    enums, modules = _imported(path, tree, root)
    found = []
    for node in ast.walk(tree):
        named = []
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                    named += right.elts
                elif isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)):
                    named += [node.left, right]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            named.append(node.value)
        elif isinstance(node, ast.MatchValue):
            named.append(node.value)
        if any(_names_a_state(item, enums, modules) for item in named):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_sources_found() -> None:
    assert len(SOURCES) > 100 and ROOT / "engine" / "actors.py" in SOURCES
    assert len(STATE_ENUMS) >= 10 and states.stage_actor.State in STATE_ENUMS


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_state_is_compared_or_assigned_outside_the_tables(path: Path) -> None:
    found = decisions_outside_tables(path)
    assert not found, (
        "a lifecycle decision made outside states/: ask a named set or mapping of the lifecycle's module instead "
        "(state in TAKES_WORK), or add one there:\n" + "\n".join(found)
    )


SAMPLE = """\
from states.stage_actor import State as ActorState
from states import stream_session as table
from states.stream_session import IN_QUEUE, State
from engine.actor_protocol import ActorState as Reexported
ok = record.status in IN_QUEUE
if actor.state is ActorState.FAILED: pass
if record.status == table.State.QUEUED: pass
record.status = State.QUEUED
if record.status in (State.QUEUED, State.RUNNING): pass
if health.state is not Reexported.RUNNING: pass
names = {State.QUEUED: "queued"}
"""


def test_the_rule_sees_what_it_should(tmp_path: Path) -> None:
    """The checker itself: one state named in a comparison or an assignment is caught, however it was imported;
    a named set and a lookup table are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(SAMPLE)
    assert sorted(int(entry.split(":")[1]) for entry in decisions_outside_tables(sample, tmp_path)) == [6, 7, 8, 9, 10]

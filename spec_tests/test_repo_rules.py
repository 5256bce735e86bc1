"""Repository rules the tests themselves must keep.

Tests are deterministic: they synchronize on events and on polls with a deadline, and
move time with trio's MockClock (``autojump_clock``), never by sleeping. A real-time
wait that is a genuine cost (a real process starting, a stage's or a close's work, a
hung process's stand-in, the poll interval of a bounded wait on other processes) says
so with a trailing ``# bench-cost: why`` on its line.

So every ``time.sleep``, ``asyncio.sleep``, ``trio.sleep`` or ``trio.sleep_until``
under ``spec_tests/`` (in code, or in the source of a child script held in a string)
either carries that mark, or is a ``trio`` sleep that advances virtual time: inside a
module-level function that takes ``autojump_clock``, or in a module whose every trio
test does. A trio sleep of zero seconds is never the way to checkpoint:
``trio.lowlevel.checkpoint()`` says what it means.

The checker's own sample of good and bad sleeps is a text file (``repo_rules_sample.txt``), not code:
nothing that greps the tree for sleeps takes it for one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SPEC_TESTS = Path(__file__).resolve().parent
SOURCES = sorted(  # this module is left out: its prose and samples name the sleeps it looks for
    path for path in SPEC_TESTS.rglob("*.py") if "__pycache__" not in path.parts and path != Path(__file__).resolve()
)
SLEEP = re.compile(r"\b(time|asyncio|anyio|trio)\.(sleep|sleep_until)\b\s*([(,)])")
ZERO = re.compile(r"\btrio\.sleep\(\s*0(\.0*)?\s*\)")
MARK = "# bench-cost:"
MARKED = re.compile(r"# bench-cost: *\S")  # the mark with its why
CLOCK = "autojump_clock"


def _takes_clock(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = node.args
    return any(arg.arg == CLOCK for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs])


def _is_autouse_fixture(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and any(
            keyword.arg == "autouse" and isinstance(keyword.value, ast.Constant) and keyword.value.value is True
            for keyword in decorator.keywords
        ):
            return True
    return False


def _virtual_spans(tree: ast.Module) -> tuple[bool, list[tuple[int, int]]]:
    """(every trio test of the module runs on the autojump clock, line spans of module-level defs taking it)."""
    functions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            functions += [item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
    autouse = any(_is_autouse_fixture(node) and _takes_clock(node) for node in functions)
    trio_tests = [node for node in functions if isinstance(node, ast.AsyncFunctionDef) and node.name.startswith("test")]
    whole_module = autouse or (bool(trio_tests) and all(_takes_clock(node) for node in trio_tests))
    spans = [(node.lineno, node.end_lineno or node.lineno) for node in functions if _takes_clock(node)]
    return whole_module, spans


def unmarked_sleeps(path: Path, root: Path = SPEC_TESTS.parent) -> list[str]:
    """``path:line: text`` (relative to ``root``) for every sleep there that breaks the rule."""
    text = path.read_text(encoding="utf-8")
    whole_module, spans = _virtual_spans(ast.parse(text, filename=str(path)))
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if MARKED.search(line):
            continue
        for match in SLEEP.finditer(line):
            virtual = match.group(1) == "trio" and (whole_module or any(a <= number <= b for a, b in spans))
            if ZERO.search(line) or not virtual:
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
                break
    return found


def test_sources_found() -> None:
    assert len(SOURCES) > 50 and SPEC_TESTS / "engine" / "test_workers.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(SPEC_TESTS)))
def test_no_unmarked_real_sleep(path: Path) -> None:
    found = unmarked_sleeps(path)
    assert not found, (
        "a real-time sleep in a test: synchronize on an event or a poll with a deadline, use the autojump "
        "clock for time, trio.lowlevel.checkpoint() for a checkpoint, or mark a genuine cost "
        f"`{MARK} why`:\n" + "\n".join(found)
    )


def test_the_rule_sees_what_it_should() -> None:
    """The checker itself: real sleeps and zero-second trio sleeps are caught; marks and virtual time are not."""
    lines = [int(entry.split(":")[1]) for entry in unmarked_sleeps(SPEC_TESTS / "repo_rules_sample.txt")]
    assert lines == [2, 4, 7, 8, 10]

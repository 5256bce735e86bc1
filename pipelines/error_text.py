"""An error told in one line, as every failure a command or a load reports is: ``KeyError: 'x'``."""

from __future__ import annotations

__all__ = ["MOST_ERROR_CHARACTERS", "error_line", "error_words", "one_line"]


def one_line(text: str) -> str:
    """``text`` on one line: a message of several lines broke the one line a failure is told in."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


#: the most of an error's words told: a pipeline's error of 100 KB (a tensor's repr, a whole config) was one line of
#: 100 KB on the terminal, burying everything before it
MOST_ERROR_CHARACTERS = 2000

#: the most members of a group an error line names, and how deep in groups within groups
MOST_GROUP_MEMBERS = 3
MOST_GROUP_DEPTH = 3


def error_words(exc: BaseException) -> str:
    """What ``exc`` says, on one line, cut past :data:`MOST_ERROR_CHARACTERS` (saying how much was left out)."""
    return _cut(one_line(str(exc)))


def _cut(said: str) -> str:
    if len(said) <= MOST_ERROR_CHARACTERS:
        return said
    return f"{said[:MOST_ERROR_CHARACTERS]}... ({len(said) - MOST_ERROR_CHARACTERS} more characters)"


def error_line(exc: BaseException, _depth: int = 0) -> str:
    """``KeyError: 'x'``, or ``RuntimeError`` for an error without words (it read ``raised RuntimeError: ``). A group
    names its first members (it read ``BaseExceptionGroup: two (2 sub-exceptions)``, what was raised hidden)."""
    said = error_words(exc)
    line = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
    if isinstance(exc, BaseExceptionGroup) and _depth < MOST_GROUP_DEPTH:
        members = exc.exceptions
        named = "; ".join(error_line(member, _depth + 1) for member in members[:MOST_GROUP_MEMBERS])
        more = f"; and {len(members) - MOST_GROUP_MEMBERS} more" if len(members) > MOST_GROUP_MEMBERS else ""
        line = _cut(f"{line}: {named}{more}")  # groups within groups: still one bounded line
    return line

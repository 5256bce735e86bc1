"""An error told in one line, as every failure a command or a load reports is: ``KeyError: 'x'``."""

from __future__ import annotations

__all__ = ["error_line", "error_words", "one_line"]


def one_line(text: str) -> str:
    """``text`` on one line: a message of several lines broke the one line a failure is told in."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def error_words(exc: BaseException) -> str:
    """What ``exc`` says, on one line."""
    return one_line(str(exc))


def error_line(exc: BaseException) -> str:
    """``KeyError: 'x'``, or ``RuntimeError`` for an error without words (it read ``raised RuntimeError: ``)."""
    said = error_words(exc)
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__

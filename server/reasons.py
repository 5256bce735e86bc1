"""Public failure reasons: what a client may read about a failure (the log keeps the detail).

A session's ``error``, the ``tf.status`` error detail and a worker's failure in health and metadata
are read by anyone holding the session id or a viewer link. They say what failed in one short line:
never a traceback, never a server file path (a path is shown by its last component), never more
than :data:`MAX_REASON` characters: a longer one keeps its start and its end, where a nested error's cause is (a
refused placement's health line ended before it named the stage and the fault).

Text a client sent that an error message repeats back (an id, a field name, a header value, a status
filter) goes through :func:`echo`: quoted, and cut to :data:`MAX_ECHO` characters with its full length
named when longer, so no refusal is larger than what it refuses needs to say.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

__all__ = ["MAX_ECHO", "MAX_REASON", "cut", "echo", "echo_each", "public_reason", "without_prefix"]

MAX_REASON: Final = 240
CUT: Final = " ... "  # where a reason past MAX_REASON was cut: its middle, the wrappers a nested error's cause is in
MAX_ECHO: Final = 64  # characters of one piece of client text an error message repeats
MAX_ECHOED: Final = 5  # pieces of client text one error message repeats (the rest are counted)

_PATH: Final = re.compile(r"(?<![\w.:/-])(?:[A-Za-z]:)?(?:[/\\][^\s/\\'\"]+)*[/\\]([^\s/\\'\"]+)")
_TRACEBACK: Final = re.compile(r"Traceback \(most recent call last\):.*", re.DOTALL)
_HEX_ADDRESS: Final = re.compile(r" at 0x[0-9a-fA-F]+")


def _line(text: str) -> str:
    text = _TRACEBACK.sub("", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def public_reason(failure: BaseException | str, *, prefix_type: bool = True) -> str:
    """One short line naming the failure: ``"ValueError: image 'upload-1.img' is not readable"``."""
    while isinstance(failure, BaseExceptionGroup) and len(failure.exceptions) == 1:
        failure = failure.exceptions[0]  # trio wraps a task's error in its nursery's group
    if isinstance(failure, BaseException):
        message = _line(str(failure))
        name = type(failure).__name__
        text = f"{name}: {message}" if prefix_type and message else (message or name)
    else:
        text = _line(failure)
    text = _PATH.sub(lambda match: match.group(1) or "<path>", text)
    text = _HEX_ADDRESS.sub("", text)
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    if len(text) > MAX_REASON:  # its start (what failed) and its end (the cause a nested error ends with)
        head = MAX_REASON // 3
        text = text[:head].rstrip() + CUT + text[len(text) - (MAX_REASON - head - len(CUT)):].lstrip()
    return text or "failed"


def cut(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` as it is when at most ``limit`` characters, else its start and its length, ``abcd... (15000
    characters in all)``: for a message that already holds client text (a parser's), and for :func:`echo`."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


def echo(value: object, limit: int = MAX_ECHO) -> str:
    """``value`` (client input) quoted for an error message: ``'abc'``, or when longer than ``limit``
    characters its start and its length, ``'abcd'... (15000 characters in all)``. Anything but text is
    shown by its ``repr``, :func:`cut` the same way."""
    if not isinstance(value, str | bytes):
        return cut(repr(value), limit)
    if len(value) <= limit:
        return repr(value)
    unit = "characters" if isinstance(value, str) else "bytes"
    return f"{value[:limit]!r}... ({len(value)} {unit} in all)"


def echo_each(values: Sequence[object]) -> str:
    """Several pieces of client input, each :func:`echo`-ed, at most :data:`MAX_ECHOED` of them
    (``'a', 'b', ... and 7 more``)."""
    shown = ", ".join(echo(value) for value in values[:MAX_ECHOED])
    more = len(values) - MAX_ECHOED
    return f"{shown} and {more} more" if more > 0 else shown


def without_prefix(text: str, prefix: str) -> str:
    """``text`` without ``prefix`` (however often it repeats) at its start, letter case and spaces aside: a reason
    relayed from a pipeline or an agent that already says what the server puts before it is not said twice (a
    refusal read ``config: config: ...``)."""
    words = re.escape(prefix.strip()).replace(r"\ ", r"\s+")
    return re.sub(rf"^(?:\s*{words})+\s*", "", text, flags=re.IGNORECASE)

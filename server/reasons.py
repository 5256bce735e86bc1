"""Public failure reasons: what a client may read about a failure (the log keeps the detail).

A session's ``error``, the ``tf.status`` error detail and a worker's failure in health and metadata
are read by anyone holding the session id or a viewer link. They say what failed in one short line:
never a traceback, never a server file path (a path is shown by its last component), never more
than :data:`MAX_REASON` characters.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["MAX_REASON", "public_reason"]

MAX_REASON: Final = 240

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
    if len(text) > MAX_REASON:
        text = text[: MAX_REASON - 3].rstrip() + "..."
    return text or "failed"

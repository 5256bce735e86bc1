"""Reading JSON objects strictly: an object that names a key twice is refused (``json`` keeps the last value
without a word). Shared by the pipelines' own files (a placement) and the server's parser of client JSON."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["RepeatedKey", "as_json", "refuse_repeated_keys"]

SHOWN_CHARACTERS = 80  # of a refused value, in a message


def as_json(value: object) -> str:
    """A refused option value as the client wrote it, in JSON (``null``, ``true``, ``"abc"``: Python's ``None``,
    ``True`` and ``'abc'`` read as another language to a client of a JSON API), cut to a line's worth."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        text = repr(value)  # not a JSON value (an option given by code, not by a client)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."


class RepeatedKey(ValueError):
    """A JSON object named ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads`: the object as a dict, or :class:`RepeatedKey`."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise RepeatedKey(key)
        found[key] = value
    return found

"""Reading JSON objects strictly: an object that names a key twice is refused (``json`` keeps the last value
without a word). Shared by the pipelines' own files (a placement) and the server's parser of client JSON."""

from __future__ import annotations

from typing import Any

__all__ = ["RepeatedKey", "refuse_repeated_keys"]


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

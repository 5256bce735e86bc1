"""A ``--placement`` refused before any pipeline loads: JSON that is no object, or more worker processes than a
placement may ask for.

``chunkline run`` and ``chunkline stream-serve`` (and the app's settings, from ``CHUNKLINE_PLACEMENT``) read the
placement's JSON, inline or from its file, and refuse it as bad input: text that is not JSON, or JSON that is not an
object (``stream-serve`` started, and its worker then refused the placement for good: a server that could never
serve, exit 0 on its stop), or a stage or a placement asking for more ranks than the limits
(:mod:`pipelines.placement_limits`). Everything else about a placement is the pipeline's to judge as it loads.
"""

from __future__ import annotations

from pipelines.placement_limits import MAX_PLACEMENT_BYTES, placement_text, ranks_problem

__all__ = ["placement_problem", "not_an_object"]


def placement_problem(placement: str) -> str | None:
    """Why ``placement`` (inline JSON starting with ``{``, or the path of a regular file) is refused, or None
    (including a file that cannot be read: the pipeline then says why)."""
    from . import json_limits

    try:
        text, where = placement_text(placement)
    except (OSError, ValueError):
        return None
    try:  # one value a byte at most: the client limit of 20,000 values would leave a 500-device list unread
        data = json_limits.loads(text, max_values=MAX_PLACEMENT_BYTES)
    except json_limits.JsonRefused as exc:  # past this reader's bounds (its depth, its values), the pipeline says
        return f"{where} is {exc.detail}" if exc.reason == "invalid_json" else None  # "not valid JSON (...)"
    if not isinstance(data, dict):
        return f"{where} must be a JSON object, got {type(data).__name__}"
    return ranks_problem(data)


def not_an_object(value: str) -> str | None:
    """For a ``--placement`` that names no file: why, when it is JSON given inline that is no object (``[]``, ``5``),
    or None (then it is a file that is not there). It was told ``is not an existing file``."""
    from . import json_limits

    try:
        given = json_limits.loads(value)
    except json_limits.JsonRefused as exc:
        return None if exc.reason == "invalid_json" else f"inline placement JSON is refused: {exc.detail}"
    return f"inline placement JSON must be an object, got {type(given).__name__}"

"""A ``--placement`` that asks for more worker processes than a placement may, found before any pipeline loads.

``chunkline run`` and ``chunkline stream-serve`` (and the app's settings, from ``CHUNKLINE_PLACEMENT``) read the
placement's JSON, inline or from its file, and refuse it as bad input naming the stage and the limit
(:mod:`pipelines.placement_limits`). Everything else about a placement is the pipeline's to judge as it loads: a
placement that does not parse here is left to it, to say why in its own words.
"""

from __future__ import annotations

from pipelines.placement_limits import MAX_PLACEMENT_BYTES, placement_text, ranks_problem

__all__ = ["placement_size_problem"]


def placement_size_problem(placement: str) -> str | None:
    """Why ``placement`` (inline JSON starting with ``{``, or the path of a regular file) asks for too many ranks,
    or None (including when it cannot be read or parsed: the pipeline then says why)."""
    from . import json_limits

    try:
        text, _ = placement_text(placement)
    except (OSError, ValueError):
        return None
    try:  # one value a byte at most: the client limit of 20,000 values would leave a 500-device list unread
        data = json_limits.loads(text, max_values=MAX_PLACEMENT_BYTES)
    except json_limits.JsonRefused:
        return None
    return ranks_problem(data)

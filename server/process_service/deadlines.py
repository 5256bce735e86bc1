"""How long a process service's proxy waits for its child to answer, per call kind.

The child's heartbeat catches a child that is frozen or whose loop is blocked; it
cannot catch a child whose loop runs while one call never finishes (a service's
``push_control`` awaiting a queue that never drains, say). Each call kind
therefore has a deadline of its own: past it the call is cancelled in the child and
fails in the parent with :class:`~server.process_service.errors.ProcessServiceCallTimeout`,
which names the call and the deadline. The service itself keeps running; the caller
decides what a late answer means. The defaults sit above the room runner's own deadlines for the
same calls, so that under a runner its cause (a stalled pipeline) is the one recorded, and every other
caller (the startup check, a benchmark, a test) is still bounded.

Chunk streams have no deadline here: a chunk comes when the session has one to
give (a controller may hold no key for minutes), so the session's own deadlines
bound them.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["CallDeadlines"]


def _seconds(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"call_deadlines.{attribute.name} must be a number of seconds > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class CallDeadlines:
    """Seconds the parent waits for the child's answer to each call; each > 0."""

    #: entering the service's ``running()`` (its warm-up and the memory report), as long as the load may take
    running: float = attrs.field(default=600.0, validator=_seconds)
    #: ``check_options`` (and ``check_image``, asked in the same call; the server's create request waits for it; the
    #: runtime's own deadline is 10 s)
    check_options: float = attrs.field(default=15.0, validator=_seconds)
    #: ``create_session``; the room runner's own ``CREATE_PIPELINE_TIMEOUT`` is 60 s
    create_session: float = attrs.field(default=90.0, validator=_seconds)
    #: ``push_control``; the runner's ``CONTROL_TIMEOUT`` is 15 s
    push_control: float = attrs.field(default=20.0, validator=_seconds)
    #: ``close_session``; the runner's ``CLOSE_PIPELINE_TIMEOUT`` is 30 s
    close_session: float = attrs.field(default=45.0, validator=_seconds)

    def of(self, call: str) -> float:
        """The deadline of ``call`` (one of the field names)."""
        if call not in attrs.fields_dict(type(self)):
            raise ValueError(f"no deadline for the process service call {call!r}")
        return float(getattr(self, call))

"""Round robin at one stage: its ready work admitted session by session, in turn.

The scheduler core keeps one queue of lanes (a session at a stage) per stage. When the stage has room,
each session with work ready is offered its place in queue order, and whoever was served goes to the back,
so no session waits behind another's stream (w2's and w4's fairness).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from .runtime import Lane
from .spec import StageSpec

__all__ = ["admit_in_turn"]


def admit_in_turn(
    stage: StageSpec, turns: deque[Lane], in_flight: Mapping[str, int], admit: Callable[[Lane], bool]
) -> None:
    """Admit ``stage``'s ready work, lane by lane in ``turns`` order, until the stage's global limit (its count in
    ``in_flight``) is reached; ``admit(lane)`` admits the lane's next item if it can. Served lanes move to the back."""
    stage_id, limit = stage.stage_id, stage.max_in_flight_global
    served: list[Lane] = []
    for lane in tuple(turns):
        if not lane.ready:
            continue
        if admit(lane):
            served.append(lane)
            if stage.max_in_flight_per_session > 1:  # else the session's one place is taken now
                while admit(lane):
                    pass
        if in_flight[stage_id] >= limit:
            break
    for lane in served:
        turns.remove(lane)
        turns.append(lane)

"""The authority's deadlines on the sessions it places on an agent, each derived from the bounds the agent's own
room runner keeps (:mod:`server.runner`), so that an honest agent always meets them and a silent one never holds a
session, or its slot, for ever.

- :func:`start_deadline`: from a Start to the session running (or ended). The runner joins the room, waits for
  the controller, and creates the pipeline session, each within its own bound; past all of them and a margin for
  the messages, the agent has left the session starting with no word (a pipeline call its deadline could not cut,
  a bug, a hostile peer), and the authority fails it.
- :data:`STOP_DEADLINE`: from a Stop to the session reported finished; past it the agent is lost.
- :data:`DRAIN_DEADLINE`: from the agent's report that a session drains (its runner's own drain, no Stop asked for
  it) to the session reported finished; past it the agent is lost, as past a Stop's deadline.
"""

from __future__ import annotations

from ..runner import (
    CLOSE_PIPELINE_TIMEOUT,
    CONNECT_TIMEOUT,
    CONTROL_TIMEOUT,
    CREATE_PIPELINE_TIMEOUT,
    DISCONNECT_TIMEOUT,
    WORKER_CAUSE_WAIT,
)

__all__ = ["DRAIN_DEADLINE", "MESSAGE_MARGIN", "NOT_FINISHED_AFTER_DRAIN", "STOP_DEADLINE", "start_deadline"]

#: seconds the agent's messages about a session may take on their way, on top of the runner's own bounds
MESSAGE_MARGIN = 10.0

#: seconds an agent has from a session's stop to reporting it finished: every bound its runner may still wait out,
#: one after another (joining the room, then creating the pipeline session, which a stop does not cut short, or
#: taking a chunk's control; closing the pipeline session; a failing worker's cause; leaving the room: 115 s) and a
#: margin for the messages. Past it the agent is lost: one that never stopped a session kept its slot and left its
#: DELETE answered "draining" for as long as it stayed connected. (It was 90 s, under an honest runner's 105 s when
#: the stop came while its pipeline took its full 60 s to create the session: the agent, and every session it
#: hosted, would have been lost.)
STOP_DEADLINE = (
    CONNECT_TIMEOUT + max(CREATE_PIPELINE_TIMEOUT, CONTROL_TIMEOUT) + CLOSE_PIPELINE_TIMEOUT + WORKER_CAUSE_WAIT
    + DISCONNECT_TIMEOUT + MESSAGE_MARGIN
)


#: seconds an agent has from reporting that a session drains to reporting it finished, where no Stop asked for the
#: drain: its runner drained on its own (the controller never came or left, the room emptied, the controller's stop,
#: the pipeline ended, stalled or failed, the room was lost, the agent's own drain stopped it at its deadline, its
#: model worker failed). A drain is one path through the runner whoever begins it (a Stop is a drain, or an abort,
#: of the same runner), so the runner may wait out what it may after a Stop, and the same deadline holds; it starts
#: no earlier than the drain did, since the agent reports the drain as it begins. A drain the authority asked for
#: keeps its Stop's deadline, and an agent's own drain with a long ``deadline_seconds`` does not lengthen it (the
#: agent stops its sessions only at that deadline; one that drained on its own before then was never waiting for
#: it). Past it the session still held its slot, ``draining``, for as long as the agent kept heartbeating.
DRAIN_DEADLINE = STOP_DEADLINE
#: how a loss past :data:`DRAIN_DEADLINE` says which deadline the session missed ("... not reported finished" first)
NOT_FINISHED_AFTER_DRAIN = f"within {DRAIN_DEADLINE:g} s of the drain its agent reported"


def start_deadline(controller_timeout: float) -> float:
    """Seconds an agent has from a session's Start to reporting it running (or ended): joining its room, the wait for
    its controller (the authority's ``controller_timeout``, which its Welcome gave the agent: an absent controller
    drains the session then), creating the pipeline session, and the margin for the messages. A drain the agent
    reports (its controller never came) takes the session out of its start: its finish is owed by
    :data:`DRAIN_DEADLINE` then."""
    return CONNECT_TIMEOUT + controller_timeout + CREATE_PIPELINE_TIMEOUT + MESSAGE_MARGIN

"""What a local room answers a client's message it does not pass on: a reason code, and a detail naming what was wrong.

Every refusal a room client meets is ``{"type": "refused", "reason": CODE, "detail": TEXT}``: a join refused for its
token or the room's state already said why (:class:`server.tokens.TokenRejected`); a message refused once joined
said only its code (``server_topic``, ``no_worker_yet``, ...), and a client had to read the server's code to learn
what to change. The codes stay as they were, for programs; the detail is for the person writing one.
"""

from __future__ import annotations

import json
from typing import Final

from ..reasons import echo_each
from .worker_inbox import WORKER_TAKE_TIMEOUT

__all__ = ["SERVER_TOPICS", "extra_envelope_fields", "refused"]

#: topics only the worker publishes on: a client's message on them is refused, so nobody poses as the server
SERVER_TOPICS: Final = frozenset({"tf.status", "tf.metrics"})

_DETAILS: Final = {
    "clients_publish_no_media": "a client sends data messages as text frames; binary frames (media) are the server's",
    "publish_data_not_allowed": "this participant's token does not allow sending data (a viewer's token subscribes only)",
    "malformed_envelope": 'a data message is a JSON object {"topic": "<string>", "payload": <any JSON>}',
    "server_topic": f"the topics {', '.join(sorted(SERVER_TOPICS))} are the server's: a client may not send on them",
    "no_worker_yet": "the session's worker is not in the room yet, so the message has nobody to go to: send it again "
                     "once the worker has joined",
    "worker_stalled": f"the session's worker took none of the room's messages within {WORKER_TAKE_TIMEOUT:g} s, so "
                      f"this one was not delivered: send it again later",
    "session_ended": "the session ended before its worker took this message: it was not delivered",
    "too_slow": "this socket fell too far behind what the room sent it (its unsent messages passed the room's bound, "
                "or the server's) and is sent away: reconnect, and read as fast as the room sends",
}


def extra_envelope_fields(envelope: dict) -> str | None:
    """The refusal's detail for an envelope with fields besides its topic and payload (None when it has none): a
    client's ``to`` or ``destination_identities`` (LiveKit's way to address one participant) was taken and ignored,
    and a message meant for one participant went to the whole room."""
    extra = sorted(set(envelope) - {"topic", "payload"}, key=str)
    if not extra:
        return None
    return (f"{_DETAILS['malformed_envelope']}, with no other field; this one also has {echo_each(extra)} (a client's "
            f"message goes to the whole room: it cannot be addressed)")


def refused(reason: str, detail: str | None = None) -> str:
    """The refusal's text frame; ``detail`` where the refusal knows more than its code (a limit, a parser's words)."""
    return json.dumps({"type": "refused", "reason": reason, "detail": detail or _DETAILS[reason]})

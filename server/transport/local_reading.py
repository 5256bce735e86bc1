"""How a local room reads one client's socket: the pace, then each message's checks, then the worker's room for it.

:meth:`server.transport.local.LocalRooms.serve_client` runs :func:`read_client` for the client's whole presence. A
message is read only when its sender's pace allows (:mod:`.data_pace`), and only once the one before it went to the
worker, which may mean waiting while the worker's inbox is full (:mod:`.worker_inbox`): meanwhile the sender's
messages wait in its own socket. Every message that is not passed on is answered to its sender with a refusal saying
why (:mod:`.refusals`); none is dropped without a word.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from .. import json_limits
from ..log_pace import LogPace
from .base import DataReceived
from .data_pace import DataPace
from .local_room import ENVELOPE_BYTES, Room, Subscriber, compact_json, data_message, largest_sent
from .refusals import SERVER_TOPICS, extra_envelope_fields
from .worker_inbox import WORKER_TAKE_TIMEOUT

__all__ = ["read_client"]

log = logging.getLogger("chunkline.rooms")
#: a worker that takes nothing can make every sender's messages refused: one line each, at a bounded pace
_stalled_log = LogPace(log)

async def read_client(
    room: Room, subscriber: Subscriber, receive: Callable[[], Awaitable[str | bytes]], pace: DataPace,
    max_data_message_bytes: int,
) -> None:
    """Read ``subscriber``'s messages until its socket ends: each passed to the worker and the room, or refused."""
    message: str | bytes = ""
    largest = max_data_message_bytes + ENVELOPE_BYTES  # the message, counted as compact UTF-8 JSON
    largest_as_sent = largest_sent(max_data_message_bytes)  # ... and as it came (with JSON's escapes, spaces)
    too_large = f"a data message's payload is at most {max_data_message_bytes} bytes (--max-data-message-bytes)"

    def refuse(reason: str, detail: str | None = None) -> None:
        """Answer the message just read with why it was refused; reading it is paid for by its size."""
        subscriber.refuse(reason, detail)
        pace.sent(len(message), 1)  # as a message the room sends its sender alone (the refusal, at least)

    while True:
        await pace.take()  # a flood waits in its own socket, not in this server's event loop
        message = await receive()
        if isinstance(message, bytes):
            refuse("clients_publish_no_media")
            continue
        # UTF-8 takes 1 to 4 bytes a character: only a text between a quarter of the bound and the bound is encoded
        size = len(message)
        if size > largest_as_sent or (size * 4 > largest_as_sent
                                      and len(message.encode("utf-8", "surrogatepass")) > largest_as_sent):
            refuse("too_large", too_large)
            continue
        if not subscriber.can_publish_data:
            refuse("publish_data_not_allowed")
            continue
        try:
            # the envelope adds one level around the payload
            envelope = json_limits.loads(message, wrapper_levels=1)
            topic = envelope["topic"]
            payload = envelope["payload"]
            if not isinstance(topic, str):
                raise TypeError("topic must be a string")
        except json_limits.JsonRefused as exc:
            reason = "malformed_envelope" if exc.reason == "invalid_json" else exc.reason
            refuse(reason, exc.detail)
            continue
        except (KeyError, TypeError):
            refuse("malformed_envelope")
            continue
        if (extra := extra_envelope_fields(envelope)) is not None:
            refuse("malformed_envelope", extra)
            continue
        if topic in SERVER_TOPICS:
            refuse("server_topic")
            continue
        raw = payload.encode() if isinstance(payload, str) else compact_json(payload)
        if len(raw) + len(compact_json(topic)) + len('{"topic":,"payload":}') > largest:  # its compact size
            refuse("too_large", too_large)
            continue
        # waits while the worker's inbox is full: the sender's next messages stay in its socket meanwhile
        if (why := await room.to_worker(DataReceived(topic, raw, subscriber.identity))) is not None:
            if why == "worker_stalled":
                _stalled_log.warning("room %s: %s's message on %r refused (worker_stalled): the worker took none of "
                                     "the room's messages within %g s", room.name, subscriber.identity, topic,
                                     WORKER_TAKE_TIMEOUT)
            refuse(why)
            continue
        text = data_message(topic, raw, subscriber.identity, parsed=payload)
        room.broadcast_text(text, skip=subscriber.identity)
        # what every other participant is sent (a viewer's backlog is counted the same way), and to how many
        pace.sent(len(text), len(room.subscribers) - 1)

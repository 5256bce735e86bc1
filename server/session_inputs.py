"""A create's prompt and image, refused when the pipeline does not take them, before anything is held or written.

A service declares the session inputs it takes (``takes_prompt``, ``takes_image``: :mod:`pipelines.contract`); a
create that gives another one is an HTTP 400 ``invalid_input`` naming the field and the pipeline, with no upload
written, no queue place, no room and no token (it was taken, the image stored, and the stream served without it).

The API process does not import the pipeline when its workers run out of process, so each worker says what its
service declares once the pipeline is loaded: in-process from the service itself, a process worker from its child's
hello, a worker agent in its Ready. Every worker runs the same pipeline (the authority refuses an agent with other
pipeline code at its register), so one's word holds for all; should two ever differ, an input is taken only when
every worker that has said takes it, as a queued session may start on any of them. Before any worker has loaded the
pipeline, a create that gives an input cannot be checked: 503 with Retry-After, as for its options (one that gives
none is taken as before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelines.contract import input_not_taken

from .reasons import echo
from .requests import BadRequest, CreateSession
from .runtime_errors import NO_WORKER_RETRY_AFTER, NoWorker
from .runtime_views import session_inputs_taken

if TYPE_CHECKING:
    from .runtime import StreamRuntime

__all__ = ["check_inputs"]


def check_inputs(runtime: StreamRuntime, body: CreateSession, image_b64: str | None, pipeline: str) -> None:
    """Raise :class:`BadRequest` (400 ``invalid_input``) for the first input of the create that the workers' pipeline
    does not take, or :class:`NoWorker` (503) when it gives one and no worker has said yet what its pipeline takes
    (unless the create would be refused anyway: the server full or stopping answers as it always does)."""
    given = [(field, name) for field, name, value in (("prompt", "prompt", body.prompt), ("image_b64", "image", image_b64),
                                                      ("image_path", "image", body.image_path)) if value is not None]
    if not given:
        return
    taken = session_inputs_taken(runtime.workers.values())  # the rule the metadata shows clients
    if taken is None:
        if runtime.would_take_session():
            raise NoWorker(f"no worker has loaded the pipeline yet to say whether it takes a {given[0][1]} "
                           f"(the create's {given[0][0]})", NO_WORKER_RETRY_AFTER)
        return
    for field, name in given:
        if name not in taken:
            raise BadRequest("invalid_input", f"{field}: {input_not_taken(name, echo(pipeline))}")

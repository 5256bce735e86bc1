"""Request bodies of the HTTP API: parsed strictly, refused with a reason that names the field.

Unknown fields are refused (400), not silently ignored: a client that sends
``imagepath`` should learn it at once rather than stream the default scene.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import trio

from pipelines.contract import prompt_problem
from pipelines.images import ImageRefused, check_decodes, check_image, check_image_file
from pipelines.paths import PathRefused, resolve_inside

from .reasons import echo, echo_each, without_prefix

__all__ = ["CreateSession", "BadRequest", "ImageSize", "LIST_LIMIT", "ListQuery", "MAX_LIST_LIMIT", "OptionsRefused",
           "SessionImageRefused", "parse_create_session", "parse_drain_request", "parse_list_query", "parse_token_request",
           "resolve_image_path"]

MAX_CONFIG_BYTES = 16384


@attrs.frozen
class ImageSize:
    """A create's image as its pipeline's ``check_image`` is asked about it: the size its header gives, and the field
    it came in (``image_b64`` or ``image_path``), which a refusal names."""

    field: str
    width: int
    height: int


@attrs.frozen
class CreateSession:
    """A validated ``POST /v1/stream/sessions`` body; ``image``: its image's size, when it gives one."""

    identity: str
    prompt: str | None = None
    image_path: str | None = None
    config: dict[str, Any] = attrs.Factory(dict)
    image: ImageSize | None = None


class BadRequest(ValueError):
    """A request the API refuses with HTTP 400; ``code`` is stable, ``detail`` names the field."""

    def __init__(self, code: str, detail: str, status: int = 400) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.status = status


class Busy(BadRequest):
    """Work of this kind is queued as deep as the server lets it: try again after ``retry_after`` s (HTTP 503)."""

    def __init__(self, code: str, detail: str, retry_after: int) -> None:
        super().__init__(code, detail, status=503)
        self.retry_after = retry_after


#: creates whose image waits for a decode (each holds its body, up to the upload limit, while it waits): past
#: these a create is turned away, so what waiting decodes hold is bounded, not one body per open connection
MAX_DECODES_WAITING = 8
DECODES_RETRY_AFTER = 2


class OptionsRefused(BadRequest):
    """The pipeline refused a session's options (``config``); ``reason`` is its own word, naming the option.

    ``worker_id``: the worker agent that relayed the refusal; the detail names it, since its words are the
    agent's (a token holder's), not this server's pipeline's. A reason that already starts with ``config:`` is
    not prefixed again.
    """

    def __init__(self, reason: str, *, worker_id: str | None = None) -> None:
        reason = without_prefix(reason, "config:") or "the options were refused, with no reason given"
        said = reason if worker_id is None else f"worker {echo(worker_id)} refused them: {reason}"
        super().__init__("invalid_option", f"config: {said}")
        self.reason = reason
        self.worker_id = worker_id


class SessionImageRefused(BadRequest):
    """The pipeline refused a session's image (its ``check_image``): a 400 ``invalid_image`` naming ``field`` with
    ``reason``, the pipeline's own words; ``worker_id`` as for :class:`OptionsRefused`."""

    def __init__(self, reason: str, *, field: str = "image", worker_id: str | None = None) -> None:
        reason = reason or "the image was refused, with no reason given"
        said = reason if worker_id is None else f"worker {echo(worker_id)} refused it: {reason}"
        super().__init__("invalid_image", f"{field}: {said}")
        self.reason = reason
        self.field = field
        self.worker_id = worker_id


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("invalid_body", "the request body must be a JSON object")
    return body


def _unknown(body: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise BadRequest("unknown_field", f"unknown field(s) {echo_each(extra)}; allowed: {sorted(allowed)}")


def _optional_str(body: dict[str, Any], name: str, limit: int) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest("invalid_field", f"{name} must be a string")
    if len(value) > limit:
        raise BadRequest("invalid_field", f"{name} is longer than {limit} characters")
    return value


def parse_create_session(
    body: Any, check_given: Callable[[CreateSession, str | None], None] | None = None
) -> tuple[CreateSession, bytes | None]:
    """``{identity, role?, prompt?, image_path?, image_b64?, config?}`` -> the request and any uploaded image.

    ``check_given(request, image_b64)`` is asked about the inputs given before an uploaded image is decoded: an image
    the pipeline does not take is refused as that, not for what the image is (a user fixed the image, only to be told
    then to leave it out)."""
    body = _object(body)
    _unknown(body, {"identity", "role", "prompt", "image_path", "image_b64", "config"})
    identity = body.get("identity")
    if not isinstance(identity, str) or not identity:
        raise BadRequest("invalid_field", "identity must be a non-empty string")
    role = body.get("role", "controller")
    if role != "controller":
        raise BadRequest("invalid_field", "role must be 'controller' (viewers use POST /v1/stream/sessions/{id}/tokens)")
    prompt = body.get("prompt")
    if prompt is not None and (problem := prompt_problem(prompt)) is not None:
        raise BadRequest("invalid_field", f"prompt {problem}")  # the rule a prompt sent in the room follows too
    image_path = _optional_str(body, "image_path", 4096)
    image_b64 = _optional_str(body, "image_b64", 1 << 30)
    if image_path is not None and image_b64 is not None:
        raise BadRequest("invalid_field", "give image_path or image_b64, not both")
    config = body.get("config", {})
    if not isinstance(config, dict):
        raise BadRequest("invalid_field", "config must be a JSON object")
    if len(json.dumps(config)) > MAX_CONFIG_BYTES:
        raise BadRequest("invalid_field", f"config is larger than {MAX_CONFIG_BYTES} bytes")
    request = CreateSession(identity=identity, prompt=prompt, image_path=image_path, config=config)
    if check_given is not None:
        check_given(request, image_b64)
    image = size = None
    if image_b64 is not None:
        try:
            image = base64.b64decode(image_b64, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("invalid_field", "image_b64 is not valid base64") from None
        if not image:
            raise BadRequest("invalid_field", "image_b64 is empty")
        size = _check_image(lambda: check_image(image), "image_b64")
    return attrs.evolve(request, image=size), image


def parse_token_request(body: Any) -> str:
    """``{identity, role?}`` -> the viewer identity."""
    body = _object(body)
    _unknown(body, {"identity", "role"})
    identity = body.get("identity")
    if not isinstance(identity, str) or not identity:
        raise BadRequest("invalid_field", "identity must be a non-empty string")
    if body.get("role", "viewer") != "viewer":
        raise BadRequest("invalid_field", "role must be 'viewer'")
    return identity


class ListQuery(NamedTuple):
    """What ``GET /v1/stream/sessions`` asks for: one status or all, one page after a cursor."""

    status: str | None
    limit: int
    after: str | None  # the cursor: the ``next`` of the page before (None: from the first)


LIST_LIMIT = 100  # sessions on a page unless ``limit`` says otherwise
MAX_LIST_LIMIT = 1000  # ... and at most: a page is made in one step of the event loop
MAX_CURSOR_CHARS = 64  # a cursor is a run's tag and a serial (``next``): longer is none
_LIST_PARAMETERS = ("after", "limit", "status")


def parse_list_query(args: Any, statuses: frozenset[str]) -> ListQuery:
    """``?status=&limit=&after=`` of the session list (a werkzeug ``MultiDict``) -> what it asks for.

    Any other parameter, or one given twice, is refused: ``?stauts=running`` listed every session, and
    ``?status=running&status=closed`` only the running ones, without a word."""
    extra = sorted(set(args.keys()) - set(_LIST_PARAMETERS))
    if extra:
        raise BadRequest("invalid_query", f"unknown query parameter(s) {echo_each(extra)}; allowed: {list(_LIST_PARAMETERS)}")
    for name in _LIST_PARAMETERS:
        given = args.getlist(name)
        if len(given) > 1:
            raise BadRequest("invalid_query", f"{name} is given {len(given)} times; give it once (or not at all)")
    status = args.get("status")
    if status is not None and status not in statuses:
        raise BadRequest("invalid_query", f"unknown status {echo(status)}")
    text = args.get("limit")
    # digits only, and few: int() would take ' 7', '+7', '7_000' and a 100,000-digit number
    if text is not None and not (text.isascii() and text.isdigit() and len(text) <= 4 and 1 <= int(text) <= MAX_LIST_LIMIT):
        raise BadRequest("invalid_query", f"limit must be an integer in 1..{MAX_LIST_LIMIT}, got {echo(text)}")
    after = args.get("after")
    if after is not None and len(after) > MAX_CURSOR_CHARS:
        raise BadRequest("invalid_query", f"after must be a cursor (the 'next' of the page before), got {echo(after)}")
    return ListQuery(status, LIST_LIMIT if text is None else int(text), after)


def parse_drain_request(body: Any, default: float, limit: float) -> float:
    """``{deadline_seconds?}`` -> the drain deadline (``default`` when not given), in (0, ``limit``]."""
    body = _object(body)
    _unknown(body, {"deadline_seconds"})
    value = body.get("deadline_seconds", default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= limit:
        raise BadRequest("invalid_field", f"deadline_seconds must be a number in (0, {limit}]")
    return float(value)


def resolve_image_path(image_path: str, assets_dir: str | None) -> tuple[str, ImageSize]:
    """A path the client named must resolve inside the assets directory (no absolute paths, no ``..``, no symlinks out):
    the file's path and its image's size."""
    if assets_dir is None:
        raise BadRequest("image_path_not_allowed", "image_path needs the server to be started with --assets-dir")
    try:
        resolved = resolve_inside(assets_dir, image_path)
    except PathRefused as exc:
        raise BadRequest("invalid_image_path", f"image_path {echo(image_path)} {exc}") from None
    return str(resolved), _check_image(lambda: check_image_file(resolved), "image_path")


async def check_image_decodes(request: CreateSession, image: bytes | None, limiter: trio.CapacityLimiter) -> None:
    """The session's image decodes (a whole header can sit over damaged pixel data), checked in a thread before
    anything is held: a 400 ``unreadable_image`` naming the field, not a session that fails once its controller
    joins. ``limiter`` bounds the decodes at once (each up to MAX_IMAGE_PIXELS); the rest wait their turn."""
    if image is None and request.image_path is None:
        return
    field, source = ("image_b64", image) if image is not None else ("image_path", request.image_path)
    if limiter.statistics().tasks_waiting >= MAX_DECODES_WAITING:
        raise Busy("busy", f"{MAX_DECODES_WAITING} images already wait to be checked; try again shortly",
                   DECODES_RETRY_AFTER)
    try:
        # a stop may cut the wait short (the decode, at most ~0.5 s, runs out on its own, its result unread)
        await trio.to_thread.run_sync(check_decodes, source, limiter=limiter, abandon_on_cancel=True)
    except ImageRefused as exc:
        raise BadRequest(exc.reason, f"{field}: {exc.detail}") from None


def _check_image(check: Any, field: str) -> ImageSize:
    """The image's header must name a supported format and a size within the decode limits: that size."""
    try:
        info = check()
    except ImageRefused as exc:
        raise BadRequest(exc.reason, f"{field}: {exc.detail}") from None
    except OSError:
        raise BadRequest("invalid_image_path", f"{field}: the file cannot be read") from None
    return ImageSize(field, info.width, info.height)

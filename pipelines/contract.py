"""The service contract between a pipeline file and the stream server.

A pipeline file defines ``get_service(gpu_num=...)`` returning one of:

- a :class:`BidirectionalService` — sessions created from a config, normalized
  controls pushed in, :class:`Chunk` s streamed out, sessions closed; it may
  hold several retained sessions when their state is isolated and a
  cross-session execution policy (the lease) shares the model;
- a :class:`ServerPushService` — chunks streamed for a request config with no
  controls; exactly one retained session.

Every service is used inside ``async with service.running():`` (load models,
start stage actors); nothing else is called outside it, except ``configure_session_capacity``, once, before it.

A service declares which session inputs it uses besides its options (:data:`SESSION_INPUTS`), with the class
attributes ``takes_prompt`` and ``takes_image`` (True unless the class says False). A request that carries an
input the service does not take is refused before anything is held (the server's create: a 400 naming the field;
``chunkline run``: exit 2 naming the flag): a setting taken and silently ignored is worse than a refusal.
"""

from __future__ import annotations

import abc
import enum
import math
import numbers
import unicodedata
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from types import MappingProxyType
from typing import Any, ClassVar

import attrs
import numpy as np

__all__ = [
    "Audio",
    "Chunk",
    "ControlType",
    "Control",
    "ControlRejected",
    "ServiceEvent",
    "check_service_event",
    "MemoryReport",
    "SessionConfig",
    "BidirectionalService",
    "ServerPushService",
    "Service",
    "KNOWN_KEYS",
    "MAX_PROMPT_CHARS",
    "prompt_problem",
    "ChunkOrder",
    "InvalidChunk",
    "PipelineContractError",
    "SESSION_INPUTS",
    "checked_session_id",
    "checked_stream",
    "input_not_taken",
    "inputs_taken",
]

# Keys a controller may hold, normalized to one name each.
KNOWN_KEYS = frozenset({"w", "a", "s", "d", "i", "j", "k", "l"})


class PipelineContractError(RuntimeError):
    """The pipeline broke this contract while serving: a bug in the pipeline, never in the request (the message
    says so: ``pipeline bug: ...``)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"pipeline bug: {detail}")
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (to or from a child process) with its detail, not its text
        return type(self), (self.detail,)


class InvalidChunk(PipelineContractError, ValueError):
    """A :class:`Chunk` or :class:`Audio` made with values the contract does not allow (a ValueError, as before)."""


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


def _pcm_bytes(pcm: object) -> bytes:
    """PCM16 as bytes: bytes-like as it is, an int16 numpy array by its samples. Anything else is refused: an int16
    array was counted by its length in samples as bytes (half its samples), and a ``str`` taken as audio."""
    if isinstance(pcm, bytes | bytearray | memoryview):
        return bytes(pcm)
    if isinstance(pcm, np.ndarray):
        if pcm.dtype != np.int16:
            raise InvalidChunk(f"audio pcm must be PCM16: bytes or an int16 array, got a {pcm.dtype} array (scale "
                               f"float samples in [-1, 1] by 32767 and cast them to int16)")
        return pcm.astype("<i2", copy=False).tobytes()
    raise InvalidChunk(f"audio pcm must be PCM16: bytes or an int16 array, got {type(pcm).__name__}")


def _count(name: str, value: object) -> int:
    """A whole number > 0 (a numpy integer, or a float such as 48000.0, too), as an int; a bool, a fraction or text
    is refused naming ``name`` (44100.5 Hz and ``True`` were taken)."""
    whole = isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and float(value).is_integer())
    if isinstance(value, bool) or not whole or int(value) <= 0:  # type: ignore[call-overload]
        raise InvalidChunk(f"{name} must be a whole number > 0, got {_shown(value)}")
    return int(value)  # type: ignore[call-overload]


def _shown(value: object) -> str:
    """``value`` as an error message shows it: its repr, cut (an int of 400 digits was shown whole)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


@attrs.frozen
class Audio:
    """Interleaved PCM16 samples for one chunk."""

    pcm: bytes
    sample_rate: int = 48000
    channels: int = 1

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "pcm", _pcm_bytes(self.pcm))
        object.__setattr__(self, "sample_rate", _count("audio sample_rate", self.sample_rate))
        object.__setattr__(self, "channels", _count("audio channels", self.channels))
        if len(self.pcm) % (2 * self.channels):
            raise InvalidChunk(
                f"audio pcm length {len(self.pcm)} is not a multiple of 2 bytes x {self.channels} channel(s)"
            )

    @property
    def samples_per_channel(self) -> int:
        return len(self.pcm) // (2 * self.channels)


@attrs.frozen(eq=False)
class Chunk:
    """One chunk of generated media: T frames of H x W x 3 uint8 at ``fps``."""

    index: int
    frames: np.ndarray
    fps: float
    audio: Audio | None = None
    applied_controls: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    metadata: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def __attrs_post_init__(self) -> None:
        index = self.index  # a numpy integer (from an array or a tensor's .item()) is taken as the int it is
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or int(index) < 0:
            raise InvalidChunk(f"chunk index must be a whole number >= 0, got {_shown(index)}")
        object.__setattr__(self, "index", int(index))
        frames = self.frames
        if not isinstance(frames, np.ndarray):
            raise InvalidChunk(f"chunk frames must be a numpy array, got {type(frames).__name__}")
        if frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
            raise InvalidChunk(f"chunk frames must be T x H x W x 3 with no empty dimension, got {frames.shape}")
        if frames.dtype != np.uint8:
            raise InvalidChunk(f"chunk frames must be uint8, got {frames.dtype}")
        fps = self.fps  # a numpy number too (np.float32 was refused as not a number); a bool is no frame rate
        try:
            rate = float(fps) if isinstance(fps, numbers.Real) and not isinstance(fps, bool) else math.nan
        except OverflowError:  # an int past a float's range
            rate = math.inf
        if not (math.isfinite(rate) and rate > 0):
            raise InvalidChunk(f"chunk fps must be a finite number > 0, got {_shown(fps)}")
        object.__setattr__(self, "fps", rate)
        if self.audio is not None and not isinstance(self.audio, Audio):
            raise InvalidChunk(f"chunk audio must be a pipelines.contract.Audio or None, got {type(self.audio).__name__}")

    @property
    def frame_count(self) -> int:
        return int(self.frames.shape[0])

    @property
    def media_seconds(self) -> float:
        return self.frame_count / self.fps


#: the longest prompt a session takes, at its start or as a control (characters)
MAX_PROMPT_CHARS = 2000


_ALLOWED_CONTROLS = "\t\n"  # the control characters a prompt may hold
#: names of the control characters a prompt is most likely to hold by mistake, for a refusal
_CONTROL_NAMES = {0x00: "NUL", 0x0D: "carriage return", 0x1B: "escape", 0x7F: "delete"}


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with ``prompt`` as a prompt's text (None when nothing is): the one rule of every way a prompt
    arrives (a create, a room message, a controls file), so none takes what another refuses."""
    if not isinstance(prompt, str):
        return "must be non-empty text"
    if len(prompt) > MAX_PROMPT_CHARS:
        return f"is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\ud800"): no text encoding can carry it
        return f"is not valid text: {exc.reason} at character {exc.start}"
    if not any(c.isprintable() and not c.isspace() for c in prompt):
        return "must be non-empty text (something other than spaces and invisible characters)"
    # NUL and the like end strings early in C code and mean nothing to a text encoder; a carriage return (a line
    # of Windows text) was taken, though the rule said tab and newline only: `--prompt "$(cat notes.txt)"`
    control = next((i for i, c in enumerate(prompt) if unicodedata.category(c) == "Cc" and c not in _ALLOWED_CONTROLS),
                   None)
    if control is not None:
        code = ord(prompt[control])
        named = f" ({_CONTROL_NAMES[code]})" if code in _CONTROL_NAMES else ""
        return (f"holds a control character ({code:#04x}) at character {control}{named}; of the control characters "
                f"only tab and newline are allowed")
    return None


class ControlType(enum.Enum):
    CONTROL_STATE = "control_state"  # the set of keys held now
    CONTROL = "control"  # one key pressed or released
    PROMPT = "prompt"  # new text conditioning
    RESET = "reset"  # release every held key (the pose stays)
    RESET_POSE = "reset_pose"  # back to the identity pose
    STOP = "stop"  # end the session


@attrs.frozen
class Control:
    """A validated, normalized control input (what the control protocol hands to a service)."""

    type: ControlType
    keys: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    key: str | None = None
    pressed: bool | None = None
    prompt: str | None = None

    def __attrs_post_init__(self) -> None:
        unknown = sorted(self.keys - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"unknown control keys {unknown} (known: {sorted(KNOWN_KEYS)})")
        if self.type is ControlType.CONTROL:
            if self.key not in KNOWN_KEYS:
                raise ValueError(f"control key must be one of {sorted(KNOWN_KEYS)}, got {self.key!r}")
            if self.pressed is None:
                raise ValueError("a control event needs pressed=True or False")
        if self.type is ControlType.PROMPT and (problem := prompt_problem(self.prompt)) is not None:
            raise ValueError(f"a prompt control's prompt {problem}")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type.value}
        if self.type is ControlType.CONTROL_STATE:
            out["controls"] = sorted(self.keys)
        if self.type is ControlType.CONTROL:
            out.update(control=self.key, event="press" if self.pressed else "release")
        if self.type is ControlType.PROMPT:
            out["prompt"] = self.prompt
        return out


class ControlRejected(ValueError):
    """A service refused a control; ``reason`` is short and safe to show the controller."""

    def __init__(self, reason: str) -> None:
        if not isinstance(reason, str):  # chunkline run finished, then failed writing it into metrics.json
            raise PipelineContractError(f"a ControlRejected's reason must be text, got {_shown(reason)}")
        super().__init__(reason)
        self.reason = reason


@attrs.frozen
class ServiceEvent:
    """Something a session's controller should hear about (e.g. ``lease_granted``)."""

    session_id: str
    type: str
    data: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.type, str):  # a chunkline run finished its chunks, then failed sorting or writing it
            raise PipelineContractError(f"a ServiceEvent's type must be text, got {_shown(self.type)}")


@attrs.frozen
class MemoryReport:
    """What the server needs to compute retained-session capacity (engine.capacity)."""

    snapshots: tuple[Any, ...]  # engine.capacity.DeviceMemorySnapshot
    role_budgets: Mapping[str, Any]  # role -> engine.capacity.SessionMemoryBudget
    untracked_bytes_per_session: int = 0


def _timeline(value: Any) -> tuple[tuple[float, Control], ...]:
    items = tuple((float(t), control) for t, control in (value or ()))
    for t, control in items:
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"timeline times must be finite and >= 0, got {t}")
        if not isinstance(control, Control):
            raise ValueError(f"timeline entries must hold Control values, got {type(control).__name__}")
    return items


@attrs.frozen
class SessionConfig:
    """What a client asked for: free-form ``options`` plus the common fields.

    ``timeline`` holds scripted controls on the media clock (offline runs): a
    service applies each to the first chunk that starts at or after its time.
    """

    prompt: str | None = None
    image_path: str | None = None
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    timeline: tuple[tuple[float, Control], ...] = attrs.field(default=(), converter=_timeline)


EventSink = Callable[[ServiceEvent], None]


def check_service_event(event: object) -> ServiceEvent:
    """What a pipeline hands its ``on_event`` sink, checked where it hands it: anything else is the pipeline's bug,
    raised into its own call (a sink that dropped it, or failed later in Python's words, named nothing)."""
    if not isinstance(event, ServiceEvent):
        raise PipelineContractError(
            f"on_event takes a pipelines.contract.ServiceEvent, got {type(event).__name__} {_shown(event)}"
        )
    return event


def check_event_session(event: ServiceEvent, session_id: str | None) -> None:
    """An event handed to one session's ``on_event`` names that session, once its id is known (``create_session``
    returned it): one naming another is the pipeline's bug, raised into its own call (it reached the controller of the
    session whose sink it was handed, and was counted as that session's)."""
    if session_id is not None and event.session_id != session_id:
        raise PipelineContractError(
            f"on_event of session {_shown(session_id)} was handed an event of session {_shown(event.session_id)} "
            f"({_shown(event.type)}): each session's events go to the on_event its create_session was given"
        )


#: the session inputs a service may take besides its options: ``SessionConfig.prompt`` and ``SessionConfig.image_path``
#: (an image given by path or uploaded); each is declared by the service's ``takes_<input>`` class attribute
SESSION_INPUTS = ("prompt", "image")


def inputs_taken(service: object) -> frozenset[str]:
    """The session inputs ``service`` (a service, its class, or a proxy for one) declares it takes: those of
    :data:`SESSION_INPUTS` whose ``takes_<input>`` is not False (an object that says nothing takes them all, as every
    service did before the declaration)."""
    return frozenset(name for name in SESSION_INPUTS if getattr(service, f"takes_{name}", True) is not False)


def input_not_taken(name: str, pipeline: str) -> str:
    """The one reason for a request that gives the session input ``name`` to ``pipeline``, whose service does not take
    it (each caller puts the field or flag it came in first)."""
    return f"pipeline {pipeline} takes no {name} (its service declares takes_{name} = False); leave it out"


class BidirectionalService(abc.ABC):
    """Sessions that take controls every chunk and stream chunks back."""

    kind: ClassVar[str] = "bidirectional"
    # True when the service applies ``SessionConfig.timeline`` itself and honours the
    # options ``continuous`` (make chunks back to back) and ``chunks`` (how many);
    # offline runs then hand it the whole script instead of pushing controls live.
    supports_timeline: ClassVar[bool] = False
    #: the service uses ``SessionConfig.prompt`` (a create's ``prompt``, ``chunkline run --prompt``); set it False when
    #: it does not, and a request that gives one is refused rather than served without it
    takes_prompt: ClassVar[bool] = True
    #: the service uses ``SessionConfig.image_path`` (a create's ``image_b64`` or ``image_path``, ``--image``); False
    #: refuses requests that give one, as ``takes_prompt``
    takes_image: ClassVar[bool] = True

    @abc.abstractmethod
    def running(self) -> AbstractAsyncContextManager[Any]:
        """Load the model and start its actors for the life of the block."""

    @abc.abstractmethod
    async def create_session(self, config: SessionConfig, *, on_event: EventSink | None = None) -> str:
        """Create isolated session state; returns the pipeline session id."""

    async def check_options(self, options: Mapping[str, Any]) -> None:
        """Refuse session options this service would refuse, with a ``ValueError`` naming the option.

        The server calls it (inside ``running()``) before it admits a session, so a bad option is an
        HTTP 400 rather than a session that fails once its controller joins. It must be the very check
        ``create_session`` runs (one source), and cheap: it holds nothing. The default takes any options.
        """

    async def check_image(self, width: int, height: int) -> None:
        """Refuse a session image of ``width`` x ``height`` pixels this service would refuse, with a ``ValueError``
        saying why (a size it cannot use).

        The server calls it (inside ``running()``) with the size in the header of a create's ``image_b64`` or
        ``image_path`` before it admits the session, so an image the pipeline cannot take is an HTTP 400 rather
        than a session that fails once its controller joins. As :meth:`check_options`: the very check
        ``create_session`` runs on the image (one source), and cheap: it holds nothing. The default takes any image.
        """

    @abc.abstractmethod
    async def push_control(self, session_id: str, control: Control) -> None:
        """Apply a control to chunks not yet started; raises ControlRejected with a reason."""

    @abc.abstractmethod
    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        """Chunks in order until the session ends (stop, last chunk, or close)."""

    @abc.abstractmethod
    async def close_session(self, session_id: str) -> None:
        """Release the session's state through its owners; idempotent."""

    def memory_report(self) -> MemoryReport | None:
        """Warm-up snapshots and per-session budgets, or None if the service does not measure."""
        return None

    @property
    def failure(self) -> object | None:
        """Why the service failed as a whole (it then leaves ``running()`` with that error), or None."""
        return None

    def configure_session_capacity(self, limit: int) -> None:
        """Told the retained-session capacity before admission starts (e.g. to size slot pools)."""


class ServerPushService(abc.ABC):
    """Chunks streamed for a request, with no controls; exactly one retained session."""

    kind: ClassVar[str] = "server_push"
    #: as :attr:`BidirectionalService.takes_prompt`: whether ``stream`` uses ``config.prompt``
    takes_prompt: ClassVar[bool] = True
    #: as :attr:`BidirectionalService.takes_image`: whether ``stream`` uses ``config.image_path``
    takes_image: ClassVar[bool] = True

    @abc.abstractmethod
    def running(self) -> AbstractAsyncContextManager[Any]:
        """Prepare whatever the stream needs for the life of the block."""

    @abc.abstractmethod
    def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        """The chunks of one stream, in order, paced by the caller."""

    async def check_options(self, options: Mapping[str, Any]) -> None:
        """As :meth:`BidirectionalService.check_options`: the very check ``stream`` runs on its options."""

    async def check_image(self, width: int, height: int) -> None:
        """As :meth:`BidirectionalService.check_image`: the very check ``stream`` runs on its image."""

    @property
    def failure(self) -> object | None:
        """Why the service failed as a whole (it then leaves ``running()`` with that error), or None."""
        return None


Service = BidirectionalService | ServerPushService


def checked_session_id(value: object) -> str:
    """What ``create_session`` returned, if it is a session id (a non-empty ``str``)."""
    if not isinstance(value, str) or not value:
        raise PipelineContractError(
            f"create_session returned {type(value).__name__} {value!r:.40}, not a session id (a non-empty str)"
        )
    return value


def checked_stream(value: object, method: str) -> AsyncIterator[Chunk]:
    """What ``chunks()`` or ``stream()`` (``method``) returned, if it is an async iterator, as the contract asks; a
    list or a plain generator failed the run in Python's words (``'list' object has no attribute '__anext__'``)."""
    if not callable(getattr(value, "__anext__", None)):
        raise PipelineContractError(
            f"{method} returned {type(value).__name__}, not an async iterator; make it an async generator "
            f"('async def' with 'yield')"
        )
    return value  # type: ignore[return-value]


class ChunkOrder:
    """Checks one stream's chunks as they come: each a :class:`Chunk`, with indexes 0, 1, 2, ... in order."""

    def __init__(self) -> None:
        self.next_index = 0

    def check(self, chunk: object) -> Chunk:
        if not isinstance(chunk, Chunk):
            raise PipelineContractError(
                f"the pipeline yielded a {type(chunk).__name__} as chunk {self.next_index}, "
                f"not a pipelines.contract.Chunk"
            )
        if chunk.index != self.next_index:
            raise PipelineContractError(
                f"chunk indexes must run 0, 1, 2, ... in order; chunk {self.next_index} of the stream has index "
                f"{chunk.index}"
            )
        self.next_index += 1
        return chunk

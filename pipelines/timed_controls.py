"""Timed controls for offline runs: a JSON script of controls on the media clock.

A JSON list of entries, each an object with a time ``t`` (seconds on the *media clock*, a number >= 0)
and a ``type``; no other fields are allowed::

    [
      {"t": 0,   "type": "control", "control": "w", "event": "press"},
      {"t": 1.5, "type": "control", "control": "ArrowUp", "event": "release"},
      {"t": 2,   "type": "control_state", "controls": ["w", "d"]},
      {"t": 3,   "type": "prompt", "prompt": "a snowy street"},
      {"t": 4,   "type": "reset"},
      {"t": 5,   "type": "reset_pose"}
    ]

- ``control``: one key pressed or released; ``control`` names the key, ``event`` is ``"press"`` or
  ``"release"`` (``event`` may be left out; it then means ``"press"``).
- ``control_state``: the complete set of keys held from then on (``[]`` releases everything); no duplicates.
- ``prompt``: new text conditioning (a non-empty string).
- ``reset`` (release every held key) and ``reset_pose`` (back to the identity pose) take nothing else.

Keys are ``w a s d i j k l`` or one of these aliases (case-insensitive): ``ArrowUp``/``up``/``forward`` = w,
``ArrowDown``/``down``/``backward`` = s, ``ArrowLeft``/``left`` = a, ``ArrowRight``/``right`` = d, and
``KeyW KeyA KeyS KeyD KeyI KeyJ KeyK KeyL`` = the letter. Entries are parsed into
:class:`pipelines.contract.Control`; a malformed file, entry or unknown key raises ``ValueError`` whose message
names the entry index (``controls entry 3: ...``).

"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .contract import KNOWN_KEYS, Control, ControlType, prompt_problem
from .paths import read_at_most

__all__ = ["KEY_ALIASES", "MAX_CONTROLS_FILE_BYTES", "TimedControl", "TimedControls", "load_timed_controls",
           "normalize_key", "parse_timed_controls"]

#: the largest controls file read (about 200,000 entries): parsed, a file takes some 20 times its size in memory,
#: and a 60 MB one took 1.4 GB before the run began
MAX_CONTROLS_FILE_BYTES = 16 << 20

KEY_ALIASES: Mapping[str, str] = {
    **{k: k for k in KNOWN_KEYS},
    **{f"key{k}": k for k in KNOWN_KEYS},
    "arrowup": "w",
    "arrowdown": "s",
    "arrowleft": "a",
    "arrowright": "d",
    "up": "w",
    "down": "s",
    "left": "a",
    "right": "d",
    "forward": "w",
    "backward": "s",
}

_ENTRY_FIELDS: Mapping[str, frozenset[str]] = {
    "control": frozenset({"t", "type", "control", "event"}),
    "control_state": frozenset({"t", "type", "controls"}),
    "prompt": frozenset({"t", "type", "prompt"}),
    "reset": frozenset({"t", "type"}),
    "reset_pose": frozenset({"t", "type"}),
}


def normalize_key(name: Any) -> str:
    """The key a name or alias stands for (``ArrowUp`` -> ``w``); ``ValueError`` for anything else."""
    if not isinstance(name, str) or name.lower() not in KEY_ALIASES:
        raise ValueError(f"unknown control {name!r} (known: {sorted(KNOWN_KEYS)} and aliases)")
    return KEY_ALIASES[name.lower()]


@attrs.frozen
class TimedControl:
    """A control to push when the media clock reaches ``t``; ``entry`` is its index in the file."""

    t: float
    control: Control
    entry: int


@attrs.frozen
class TimedControls:
    """Timed controls in push order (by ``t``, file order for equal times)."""

    entries: tuple[TimedControl, ...] = ()

    def __len__(self) -> int:
        return len(self.entries)


def _parse_entry(index: int, raw: Any) -> TimedControl:
    def bad(problem: str) -> ValueError:
        return ValueError(f"controls entry {index}: {problem}")

    if not isinstance(raw, dict):
        raise bad(f"must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind not in _ENTRY_FIELDS:
        raise bad(f"unknown or missing type {kind!r} (known: {sorted(_ENTRY_FIELDS)})")
    extra = sorted(str(k) for k in raw if k not in _ENTRY_FIELDS[kind])
    if extra:
        raise bad(f"unexpected field(s) {extra} for type {kind!r}")
    if "t" not in raw:
        raise bad("missing time 't'")
    t = raw["t"]
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise bad(f"'t' must be a finite number >= 0 (seconds), got {t!r}")
    try:
        if kind == "control":
            if "control" not in raw:
                raise bad("a 'control' entry needs 'control' (the key)")
            event = raw.get("event", "press")
            if not isinstance(event, str) or event.lower() not in ("press", "release"):
                raise bad(f"'event' must be 'press' or 'release', got {event!r}")
            control = Control(ControlType.CONTROL, key=normalize_key(raw["control"]), pressed=event.lower() == "press")
        elif kind == "control_state":
            keys = raw.get("controls")
            if not isinstance(keys, list):
                raise bad(f"'controls' must be a list of keys, got {keys!r}")
            normalized = [normalize_key(k) for k in keys]
            if len(set(normalized)) != len(normalized):
                raise bad(f"'controls' names a key twice: {keys!r}")
            control = Control(ControlType.CONTROL_STATE, keys=frozenset(normalized))
        elif kind == "prompt":
            prompt = raw.get("prompt")
            problem = prompt_problem(prompt)
            if problem is not None:
                raise bad(f"'prompt' {problem}")
            control = Control(ControlType.PROMPT, prompt=prompt)
        elif kind == "reset":
            control = Control(ControlType.RESET)
        else:
            control = Control(ControlType.RESET_POSE)
    except ValueError as exc:
        if str(exc).startswith(f"controls entry {index}:"):
            raise
        raise bad(str(exc)) from exc
    return TimedControl(t=float(t), control=control, entry=index)


def parse_timed_controls(data: Any) -> TimedControls:
    """Parse decoded JSON (a list of entries; see the module docstring)."""
    if not isinstance(data, list):
        raise ValueError(f"controls must be a JSON list of entries, got {type(data).__name__}")
    parsed = [_parse_entry(i, raw) for i, raw in enumerate(data)]
    return TimedControls(tuple(sorted(parsed, key=lambda e: (e.t, e.entry))))


def load_timed_controls(path: str | os.PathLike[str], *, loads: Callable[[str], Any] = json.loads) -> TimedControls:
    """Read and parse a timed controls file; every problem is a ``ValueError`` naming the file. ``loads`` parses
    its text: ``chunkline run`` passes the server's parser of client JSON, which also refuses an object naming a
    key twice (the last would silently win) and deep nesting, as a request body's are."""
    try:
        raw = read_at_most(path, MAX_CONTROLS_FILE_BYTES)
        if raw is None:
            raise ValueError(f"controls file {str(path)!r} is larger than {MAX_CONTROLS_FILE_BYTES >> 20} MiB, "
                             f"the most a run reads")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"controls file {str(path)!r} cannot be read: {exc}") from exc
    try:
        data = loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: plain json.loads on nested lists
        raise ValueError(f"controls file {str(path)!r} is not valid JSON: {exc}") from exc
    except ValueError as exc:  # a parser that says what it refused (the server's: "not valid JSON (...)", ...)
        raise ValueError(f"controls file {str(path)!r}: {exc}") from exc
    try:
        return parse_timed_controls(data)
    except ValueError as exc:
        raise ValueError(f"controls file {str(path)!r}: {exc}") from exc

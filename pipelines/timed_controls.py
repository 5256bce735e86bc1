"""Timed controls for offline runs: a JSON script of controls on the media clock.

A JSON list of at most 200,000 entries (in a file of at most 16 MiB), each an object with a time ``t``
(seconds on the *media clock*, a number >= 0 that a float holds) and a ``type`` (text); no other fields are
allowed::

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

__all__ = ["KEY_ALIASES", "MAX_CONTROLS_ENTRIES", "MAX_CONTROLS_FILE_BYTES", "MAX_CONTROLS_VALUES", "TimedControl", "TimedControls", "load_timed_controls",
           "normalize_key", "parse_timed_controls"]

#: the largest controls file read: parsed, a file takes some 20 times its size in memory, and a 60 MB one took
#: 1.4 GB before the run began
MAX_CONTROLS_FILE_BYTES = 16 << 20
#: the most entries a controls file holds (200,000 of the largest entry fill the 16 MiB; parsed in some 3.5 s and
#: 0.5 GB): a file of more is refused before its entries are read
MAX_CONTROLS_ENTRIES = 200_000
#: the most JSON values (as :func:`server.json_limits.loads` counts them, one a separator) of a controls file that
#: ``chunkline run`` parses: 13 an entry, what a ``control_state`` entry of all eight keys holds, so that every
#: file of at most :data:`MAX_CONTROLS_ENTRIES` entries is read, and 16 MiB of the smallest entries is refused
#: before it is parsed (730,000 of them took 5.8 s). The client limit of 20,000 values refused 5,000 entries.
MAX_CONTROLS_VALUES = 13 * MAX_CONTROLS_ENTRIES

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


SHOWN = 80  # characters of a value a message repeats


def _shown(value: Any) -> str:
    """``value``'s ``repr`` for a message, cut to its first 80 characters and its length when longer (a 400-digit
    ``t`` or a list of thousands of keys was repeated whole)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters in all)"


def normalize_key(name: Any) -> str:
    """The key a name or alias stands for (``ArrowUp`` -> ``w``); ``ValueError`` for anything else."""
    if not isinstance(name, str):
        raise ValueError(f"a control must be a key's name (text), got {type(name).__name__} {_shown(name)}")
    if name.lower() not in KEY_ALIASES:
        raise ValueError(f"unknown control {_shown(name)} (known: {sorted(KNOWN_KEYS)} and aliases)")
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


def _entry_type(raw: Mapping[str, Any]) -> str:
    """The entry's ``type``: text naming a known type (a list or an object was looked up as a key, and raised
    ``TypeError: unhashable type``, exit 1)."""
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in _ENTRY_FIELDS:
        given = _shown(kind) if kind is None or isinstance(kind, str) else f"{type(kind).__name__} {_shown(kind)}"
        raise ValueError(f"unknown or missing type {given} (known: {sorted(_ENTRY_FIELDS)})")
    return kind


def _entry_time(raw: Mapping[str, Any]) -> float:
    """The entry's ``t`` in seconds: a finite number >= 0 that a float holds (an integer of 400 digits raised
    ``OverflowError: int too large to convert to float``, exit 1)."""
    if "t" not in raw:
        raise ValueError("missing time 't'")
    t = raw["t"]
    problem = f"'t' must be a finite number >= 0 (seconds), got {_shown(t)}"
    if isinstance(t, bool) or not isinstance(t, int | float):
        raise ValueError(problem)
    try:
        seconds = float(t)
    except OverflowError:
        raise ValueError(f"{problem}: too large for a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(problem)
    return seconds


def _entry_control(kind: str, raw: Mapping[str, Any]) -> Control:
    """The control an entry of type ``kind`` stands for, each of its fields checked for its type and value."""
    if kind == "control":
        if "control" not in raw:
            raise ValueError("a 'control' entry needs 'control' (the key)")
        event = raw.get("event", "press")
        if not isinstance(event, str) or event.lower() not in ("press", "release"):
            raise ValueError(f"'event' must be 'press' or 'release', got {_shown(event)}")
        name = raw["control"]
        if not isinstance(name, str):
            raise ValueError(f"'control' must be a key's name (text), got {type(name).__name__} {_shown(name)}")
        return Control(ControlType.CONTROL, key=normalize_key(name), pressed=event.lower() == "press")
    if kind == "control_state":
        keys = raw.get("controls")
        if not isinstance(keys, list):
            raise ValueError(f"'controls' must be a list of keys, got {_shown(keys)}")
        normalized = []
        for index, name in enumerate(keys):
            try:
                normalized.append(normalize_key(name))
            except ValueError as exc:
                raise ValueError(f"'controls' item {index}: {exc}") from None
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"'controls' names a key twice: {_shown(keys)}")
        return Control(ControlType.CONTROL_STATE, keys=frozenset(normalized))
    if kind == "prompt":
        prompt = raw.get("prompt")
        if (problem := prompt_problem(prompt)) is not None:
            raise ValueError(f"'prompt' {problem}")
        return Control(ControlType.PROMPT, prompt=prompt)
    return Control(ControlType.RESET if kind == "reset" else ControlType.RESET_POSE)


def _parse_entry(index: int, raw: Any) -> TimedControl:
    """One entry, every field checked for its type and range: a problem is a ``ValueError`` naming the entry and
    the field (exit 2 under ``chunkline run``), never a ``TypeError`` or ``OverflowError`` of Python's (exit 1)."""
    try:
        if not isinstance(raw, dict):
            raise ValueError(f"must be a JSON object, got {type(raw).__name__}")
        kind = _entry_type(raw)
        extra = sorted(str(k) for k in raw if k not in _ENTRY_FIELDS[kind])
        if extra:
            raise ValueError(f"unexpected field(s) {_shown(extra)} for type {kind!r}")
        t = _entry_time(raw)
        control = _entry_control(kind, raw)
    except ValueError as exc:
        raise ValueError(f"controls entry {index}: {exc}") from None
    return TimedControl(t=t, control=control, entry=index)


def parse_timed_controls(data: Any) -> TimedControls:
    """Parse decoded JSON (a list of entries; see the module docstring)."""
    if not isinstance(data, list):
        raise ValueError(f"controls must be a JSON list of entries, got {type(data).__name__}")
    if len(data) > MAX_CONTROLS_ENTRIES:
        raise ValueError(f"{len(data)} entries; at most {MAX_CONTROLS_ENTRIES} are allowed")
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
        text = raw.decode("utf-8-sig")  # a byte-order mark first (Windows' Notepad writes one) is no content
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

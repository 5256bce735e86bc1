"""Bounded JSON parsing: one parser for every JSON a client sends (HTTP bodies, room messages).

``json.loads`` alone accepts nesting as deep as Python's recursion allows and then raises
``RecursionError`` (an HTTP 500 or a dropped socket), and it accepts ``"\\ud800"``: text that
cannot be encoded again and fails whatever later writes it. :func:`loads` refuses both up
front with a :class:`JsonRefused` whose ``reason`` is stable:

==================  ==========================================================
``invalid_json``    not UTF-8, or not JSON (NaN and Infinity are not JSON)
``too_deep``        arrays/objects nested deeper than ``max_depth``
``too_many_values`` more than ``max_values`` values (``[1,1,...]`` of 8 MiB took 2-3 s of the event loop to
                    parse, only to be refused for its size afterwards)
``unencodable_text`` a string or key holds a lone surrogate (not UTF-8 encodable)
``duplicate_key``   one object names a key twice (``json.loads`` keeps the last one without a word)
``out_of_range``    a number too large for a float (``1e400``: ``json.loads`` makes it infinity,
                    which no JSON can carry on), or an integer of more than 1000 digits
==================  ==========================================================

:func:`payload_body` is how a room hub reads a data message's payload bytes for its fan-out: as
JSON when :func:`loads` takes them, else as text (a client's payload is opaque to the hub; plain
``json.loads`` there let one 2 KB string of nested brackets raise ``RecursionError`` and end the
server).

The depth and the number of values are measured before parsing, on the raw bytes with string contents
removed, so a deep or a huge document costs one linear scan and no Python objects.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

import numpy as np

from pipelines.json_objects import RepeatedKey, refuse_repeated_keys

from .reasons import echo

__all__ = ["MAX_JSON_DEPTH", "MAX_JSON_VALUES", "JsonRefused", "loads", "nesting_depth", "payload_body"]

MAX_JSON_DEPTH: Final = 32
#: values a client's document may hold: far more than any API body (a session's config is at most 16 KiB) or
#: control message has; an image travels as one string, one value
MAX_JSON_VALUES: Final = 20_000

#: a string (its escapes taken out first: :func:`_structure`), or an unterminated one to the end: a document that never
#: closes a string was matched again from each later quote, quadratic (64 KB of \" pairs held the event loop 12 s)
_STRING: Final = re.compile(rb'"[^"]*(?:"|\Z)')
#: quotes a document may hold before its strings are looked at: two a value, and escaped ones inside text
_QUOTES_PER_VALUE: Final = 4
_BLOCK: Final = 1 << 18
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")


class JsonRefused(ValueError):
    """A client's JSON was refused; ``reason`` is ``invalid_json``, ``too_deep``, ``too_many_values``,
    ``unencodable_text``, ``duplicate_key`` or ``out_of_range``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def nesting_depth(raw: bytes) -> int:
    """The deepest array/object nesting of ``raw`` (brackets inside strings do not count)."""
    return _depth(_structure(raw))


def _structure(raw: bytes) -> bytes:
    """``raw`` without its strings' contents. Escaped backslashes, then escaped quotes, go first (in C): a pattern
    that steps over each escape took a regex step per escape (8 MiB of \\\\ pairs: 0.3 s of the event loop)."""
    return _STRING.sub(b"", raw.replace(b"\\\\", b"").replace(b'\\"', b""))


def _values(structure: bytes) -> int:
    """How many values a document holds at most, from its bytes outside strings: one more than its separators."""
    return structure.count(b",") + structure.count(b":") + 1


def _depth(structure: bytes) -> int:
    brackets = structure.translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    deepest = level = 0
    for start in range(0, len(brackets), _BLOCK):  # blocks keep the scan's own memory small
        codes = np.frombuffer(brackets, dtype=np.uint8, count=min(_BLOCK, len(brackets) - start), offset=start)
        opens = (codes == ord("[")) | (codes == ord("{"))
        levels = np.cumsum(opens.astype(np.int8) * 2 - 1, dtype=np.int64) + level
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity: Python's parser takes them, JSON has no such values."""


def _reject_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not JSON")


class _OutOfRange(ValueError):
    def __init__(self, text: str, kind: str) -> None:
        super().__init__(text)
        self.text = text
        self.kind = kind  # "an integer" or "a float"


MAX_INT_DIGITS: Final = 1000  # far past any count a client sends (Python itself refuses past 4300)


def _bounded_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:  # digits only: a JSON integer's one sign is "-"
        raise _OutOfRange(text, "an integer")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _OutOfRange(text, "a float")
    return value


def _check_encodable(value: Any) -> None:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            item.encode("utf-8")  # UnicodeEncodeError on a lone surrogate
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def loads(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, max_values: int = MAX_JSON_VALUES,
          wrapper_levels: int = 0) -> Any:
    """Parse client JSON, refusing invalid, too deep, too large or unencodable documents and objects that name a
    key twice (:class:`JsonRefused`).

    ``wrapper_levels``: levels of an envelope around what the client counts (a room message's ``{"topic", "payload"}``),
    taken on top of ``max_depth``; a ``too_deep`` refusal gives the depth without them (a payload nested 33 deep was
    told "34 levels deep; at most 33")."""
    if isinstance(raw, str):
        try:
            data = raw.encode("utf-8")
        except UnicodeEncodeError:
            raise JsonRefused("unencodable_text", "the message holds text that is not valid Unicode") from None
    else:
        data = bytes(raw)
    if data.count(b'"') > _QUOTES_PER_VALUE * max_values:  # millions of "" cost the string scan a second
        raise JsonRefused("too_many_values", f"JSON of more than {max_values} values; at most {max_values} allowed")
    structure = _structure(data)
    depth = _depth(structure)
    if depth - wrapper_levels > max_depth:
        raise JsonRefused("too_deep", f"JSON nested {depth - wrapper_levels} levels deep; at most {max_depth} allowed")
    values = _values(structure)
    if values > max_values:
        raise JsonRefused("too_many_values", f"JSON of {values} values; at most {max_values} allowed")
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float,
                           parse_int=_bounded_int, object_pairs_hook=refuse_repeated_keys)
    except RepeatedKey as exc:
        raise JsonRefused("duplicate_key", f"key {echo(exc.key)} appears twice in one object") from None
    except _OutOfRange as exc:
        raise JsonRefused("out_of_range", f"the number {echo(exc.text)} is too large for {exc.kind}") from None
    except _NotJson as exc:
        raise JsonRefused("invalid_json", f"not valid JSON ({exc})") from None
    except UnicodeDecodeError:
        raise JsonRefused("invalid_json", "not valid UTF-8") from None
    except json.JSONDecodeError as exc:  # where, not what: the text around it may be anything
        raise JsonRefused("invalid_json", f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:  # nesting past Python's own limit (the depth check above keeps to far less)
        raise JsonRefused("invalid_json", "not valid JSON (nested too deep)") from None
    try:
        _check_encodable(value)
    except UnicodeEncodeError:
        raise JsonRefused("unencodable_text", "a string holds a lone surrogate (\\ud800-\\udfff): not encodable text") from None
    return value


def payload_body(payload: bytes) -> Any:
    """A data message's payload for a hub's fan-out: its JSON when :func:`loads` takes it, else its text.

    Never raises: whatever a client put in a payload, the hub passes on something every
    participant can parse (too deep, duplicate keys, NaN or 1e400 travel as text).
    """
    try:
        return loads(payload)
    except JsonRefused:
        return payload.decode("utf-8", "replace")

"""The front's fast path for the common request head: one that h11 reads exactly as it is written.

Reading every head with h11 and writing it again for hypercorn (:func:`server.http_framing.parse_head_by_h11`)
cost about a fifth of a trivial request's CPU at the front. Most heads are plain: :func:`scan_plain_head` takes
one with a single regular expression and a look at its field names, and gives the head h11 would give, with the
bytes as sent to be forwarded unchanged (h11 would write them again to the same bytes, up to the optional
whitespace it strips, which hypercorn's h11 strips the same way). A head is plain when it has

- a request line ``METHOD /target HTTP/1.x`` of a known method, a target in origin form (``/`` then printable
  ASCII, no space), HTTP/1.1 or HTTP/1.0, single spaces;
- field lines ``name: value`` with a token for a name, printable ASCII values (spaces and tabs inside), no
  continuation line (obs-fold), no control character, no byte above 0x7e;
- ``\\r\\n`` after every line;
- one ``Host`` (HTTP/1.0: at most one), at most one ``Content-Length`` of 1-20 digits, and no
  ``Transfer-Encoding``, ``Upgrade`` or ``HTTP2-Settings`` (those the front refuses, serves itself or drops).

Anything else -- refused or not -- is not decided here: :func:`scan_plain_head` returns None and h11 reads it
(``spec_tests/security/test_plain_heads.py`` checks on generated heads that the two never disagree).
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["PLAIN_METHODS", "PlainHead", "scan_plain_head"]

PLAIN_METHODS: Final = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH")
_TOKEN: Final = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_VALUE: Final = rb"(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?"  # h11's field value, printable ASCII only
_HEAD: Final = re.compile(
    rb"(?P<method>" + b"|".join(PLAIN_METHODS) + rb") (?P<target>/[\x21-\x7e]*) HTTP/(?P<version>1\.[01])\r\n"
    rb"(?P<fields>(?:" + _TOKEN + rb":[ \t]*" + _VALUE + rb"[ \t]*\r\n)*)\r\n"
)
_FIELD: Final = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _VALUE + rb")[ \t]*\r\n")
_DIGITS: Final = re.compile(rb"[0-9]{1,20}")
#: fields whose presence sends a head to h11: the front refuses (411), serves (WebSocket) or drops them
_NOT_PLAIN: Final = frozenset({b"transfer-encoding", b"upgrade", b"http2-settings"})

#: a plain head: method, target, HTTP version and its fields (names as sent, values without surrounding whitespace)
PlainHead = tuple[bytes, bytes, bytes, tuple[tuple[bytes, bytes], ...]]


def scan_plain_head(raw: bytes) -> PlainHead | None:
    """``raw`` (a whole head, its blank line included) read as h11 reads it, when it is plain (see the module);
    None when it is not, whether h11 would take it or refuse it."""
    match = _HEAD.fullmatch(raw)
    if match is None:
        return None
    fields = tuple((name, value) for name, value in _FIELD.findall(raw, match.start("fields"), match.end("fields")))
    hosts = lengths = 0
    for name, value in fields:
        lowered = name.lower()
        if lowered == b"host":
            hosts += 1
        elif lowered == b"content-length":
            lengths += 1
            if _DIGITS.fullmatch(value) is None:
                return None
        elif lowered in _NOT_PLAIN:
            return None
    version = match["version"]
    if hosts > 1 or (hosts == 0 and version == b"1.1") or lengths > 1:
        return None
    return match["method"], match["target"], version, fields

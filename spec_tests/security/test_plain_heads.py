"""The front's fast path for plain request heads (``server/plain_head.py``) and h11 never disagree: a head the
fast path takes, h11 takes too and reads the same (method, target, version, every field as h11 leaves it), and
for every head :func:`server.http_framing.parse_head` (fast path first) answers exactly as h11 alone does --
the same head, or the same refusal. Heads are generated around the edges of what is plain: methods, targets,
versions, separators, field names and values, line endings, repeated ``Host`` and ``Content-Length`` fields,
obs-fold and control bytes. What is forwarded of a plain head is its bytes as sent."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from server.http_framing import FramingRefused, RequestHead, head_end, parse_head, parse_head_by_h11
from server.plain_head import scan_plain_head

#: (plain, edge) choices for each part of a head: a part is plain nine times in ten, so that about a third of the
#: heads are plain and the rest differ from a plain one in a part or two
METHODS = ([b"GET", b"POST", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"PUT"],
           [b"get", b"PRI", b"CONNECT", b"GE T", b"", b"G\x00T", b"FOO"])
GAPS = ([b" "], [b"  ", b"\t", b""])
TARGETS = ([b"/", b"/v1/service/health", b"/a?b=c&d=%20", b"//v1/rooms/r/ws", b"/~!$&'()*+,;=:@"],
           [b"*", b"http://x/y", b"/a b", b"/a\x00b", b"/\x7f", b"/\xc3\xa9", b"", b"a"])
VERSIONS = ([b"1.1", b"1.1", b"1.0"], [b"2.0", b"1.2", b"11", b"", b"0.9"])
NAMES = ([b"Connection", b"X-Token", b"Accept", b"Content-Type", b"content-length", b"Content-Length", b"User-Agent"],
         [b"Host", b"host", b"Transfer-Encoding", b"Upgrade", b"HTTP2-Settings", b"a b", b"x\x00y", b"", b" Host",
          b"Host ", b"\xc3\xa9", b"X(y)"])
VALUES = ([b"x", b"localhost:8088", b"0", b"25", b"007", b"a b\tc", b"keep-alive", b"*/*", b"", b"1" * 20],
          [b"1,1", b"1, 2", b"-1", b"1" * 21, b" x ", b"\tx\t", b"chunked", b"websocket", b"h2c", b"\xc3\xa9",
           b"a\x00b", b"a\rb", b"a\x7fb", b"a\x0bb"])
LENGTHS = [b"0", b"25", b"007", b"1" * 20, b"1" * 21, b"1,1", b"1, 1", b"1,2", b"-1", b"+1", b"0x1", b"", b"1 1",
           b"\xd9\xa3"]  # Content-Length values: plain up to 20 digits
SEPARATORS = ([b": ", b":"], [b":\t", b" : ", b":  ", b": \t"])
ENDINGS = ([b"\r\n"], [b"\n", b"\r", b"\r\r\n"])


def part(draw: Any, choices: tuple[list[bytes], list[bytes]]) -> bytes:
    plain, edge = choices
    return draw(st.sampled_from(plain if draw(st.integers(0, 9)) else edge))


@st.composite
def heads(draw: Any) -> bytes:
    """A head (up to its blank line) near the edges of what the fast path takes: plain, or a part or two off."""
    raw = b"%s%s%s%sHTTP/%s%s" % (part(draw, METHODS), part(draw, GAPS), part(draw, TARGETS), part(draw, GAPS),
                                   part(draw, VERSIONS), part(draw, ENDINGS))
    if draw(st.integers(0, 9)):  # the usual Host
        raw += b"Host: x" + part(draw, ENDINGS)
    for _ in range(draw(st.integers(0, 2))):  # Content-Length fields, often one, sometimes two
        if draw(st.booleans()):
            raw += b"Content-Length: " + draw(st.sampled_from(LENGTHS)) + part(draw, ENDINGS)
    for _ in range(draw(st.integers(0, 5))):
        raw += part(draw, NAMES) + part(draw, SEPARATORS) + part(draw, VALUES) + part(draw, ENDINGS)
        if not draw(st.integers(0, 19)):  # an obs-fold continuation line
            raw += b" more" + part(draw, ENDINGS)
    raw += part(draw, ENDINGS)
    end = head_end(raw)
    return raw[:end] if end >= 0 else raw


def outcome(parse: Any, raw: bytes) -> RequestHead | tuple[int, str, str | None]:
    try:
        return parse(raw)
    except FramingRefused as exc:
        return exc.status, exc.detail, exc.error


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=heads())
def test_the_fast_path_and_h11_agree_on_every_generated_head(raw: bytes) -> None:
    by_h11 = outcome(parse_head_by_h11, raw)
    plain = scan_plain_head(raw)
    if plain is not None:
        assert isinstance(by_h11, RequestHead), (raw, by_h11)  # the fast path takes only what h11 takes
        assert RequestHead(*plain) == by_h11, raw  # and reads it as h11 does
    assert outcome(parse_head, raw) == by_h11, raw


@pytest.mark.parametrize("raw", [
    b"GET /v1/service/health HTTP/1.1\r\nHost: bench\r\n\r\n",  # bench.front's request
    b"GET /v1/stream/health HTTP/1.1\r\nHost: 127.0.0.1:8088\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\n",
    b"POST /v1/stream/sessions HTTP/1.1\r\nHost: localhost:8088\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\nUser-Agent: python-httpx/0.28.1\r\nContent-Length: 25\r\n"
    b"Content-Type: application/json\r\n\r\n",
    b"DELETE /v1/stream/sessions/s-1 HTTP/1.0\r\n\r\n",
], ids=["bench", "curl", "httpx-post", "http-1.0"])
def test_the_common_heads_take_the_fast_path_and_go_on_as_sent(raw: bytes) -> None:
    head = parse_head(raw)
    assert head.raw == raw and scan_plain_head(raw) is not None
    assert head == parse_head_by_h11(raw)


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\nHost: x\n\n",  # bare LF: written again with CRLF
    b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nHTTP2-Settings: AAAA\r\n\r\n",  # the upgrade fields dropped
    b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  2\r\n\r\n",  # obs-fold
], ids=["bare-lf", "h2c-upgrade", "obs-fold"])
def test_a_head_that_is_not_plain_is_read_by_h11_and_written_again(raw: bytes) -> None:
    assert scan_plain_head(raw) is None
    head = parse_head(raw)
    assert head.raw is None and head == parse_head_by_h11(raw)

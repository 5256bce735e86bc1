"""Hostile HTTP clients: every resource a request can make the server spend is bounded first, every
refusal is a 4xx with a reason, and no route answers 5xx (principles 1, 4, 5, 7 and 8 of the
hostile-clients issue). Room-socket attacks are in ``test_hostile_rooms.py``; attacks through a
real server's sockets in ``test_hostile_server.py``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, strategies as st
from werkzeug.datastructures import Headers

from pipelines.images import MAX_IMAGE_SIDE, ImageRefused, check_image, load_image
from server.json_limits import MAX_INT_DIGITS, MAX_JSON_DEPTH, MAX_JSON_VALUES
from server.runtime import MAX_VIEWERS_PER_SESSION

from ..server.conftest import assert_error_body, make_settings, png_bytes, serve
from .helpers import FUZZ_SETTINGS, run_hypothesis_in_thread

SESSIONS = "/v1/stream/sessions"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width x height`` followed by a tiny (truncated) IDAT: a decompression bomb's header."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    idat = zlib.compress(b"\x00" * 4096)
    return b"\x89PNG\r\n\x1a\n" + chunk + struct.pack(">I", len(idat)) + b"IDAT" + idat


def jpeg_header(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def webp_over(canvas: tuple[int, int], bitstream: tuple[int, int], *, framed: bool = False) -> bytes:
    """An extended WebP whose canvas (``VP8X``) says ``canvas`` over a lossless bitstream (``VP8L``) of ``bitstream``
    (in an animation frame, ``ANMF``, when ``framed``): the decoder makes the bitstream's size."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return kind + struct.pack("<I", len(payload)) + payload + b"\x00" * (len(payload) & 1)

    def size24(width: int, height: int) -> bytes:
        return (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")

    width, height = bitstream
    lossless = chunk(b"VP8L", b"\x2f" + ((width - 1) | (height - 1) << 14).to_bytes(4, "little") + b"\x00" * 8)
    image = chunk(b"ANMF", b"\x00" * 6 + size24(*bitstream) + b"\x00" * 4 + lossless) if framed else lossless
    body = b"WEBP" + chunk(b"VP8X", b"\x00" * 4 + size24(*canvas)) + image
    return b"RIFF" + struct.pack("<I", len(body)) + body


def jpeg_refined(first: tuple[int, int], second: tuple[int, int]) -> bytes:
    """A JPEG with two frame headers before its scan, the second larger: the decoder takes the second."""
    one, two = jpeg_header(*first)[:-2], jpeg_header(*second)[2:-2]
    return one + two[two.index(b"\xff\xc0"):] + b"\xff\xda" + struct.pack(">H", 2) + b"\xff\xd9"


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"k": value}
    return value


# -- principle 1: decoded pixels are bounded before decoding ---------------------------------------


@pytest.mark.parametrize(
    "image",
    [png_header(60000, 60000), png_header(MAX_IMAGE_SIDE + 1, 8), jpeg_header(30000, 20000),
     # a small size said first over a large one the decoder makes (a 50-byte WebP decoded to 16000 x 16000: 1 GB)
     webp_over((100, 100), (16000, 16000)), webp_over((100, 100), (16000, 16000), framed=True),
     jpeg_refined((100, 100), (16000, 16000))],
    ids=["png-60000", "png-one-over-the-side", "jpeg-30000x20000", "webp-canvas-over-bitstream",
         "webp-canvas-over-frame", "jpeg-second-frame-header"],
)
async def test_an_image_bomb_is_refused_from_its_header(image: bytes) -> None:
    async with serve() as s:
        status, body, _ = await s.create("ctl", image_b64=base64.b64encode(image).decode())
        assert status == 400
        assert_error_body(status, body, "image_too_large")
        assert "MAX_IMAGE_SIDE" in body["detail"] and "pixels" in body["detail"]
        assert not list(s.runtime.registry) and not s.runtime.runners  # nothing was admitted or stored
        assert s.runtime.uploads.path is None or not os.listdir(s.runtime.uploads.path)


async def test_an_image_that_is_not_a_known_format_is_refused() -> None:
    async with serve() as s:
        status, body, _ = await s.create("ctl", image_b64=base64.b64encode(b"GIF8" + b"\x00" * 64).decode())
        assert status == 400
        assert_error_body(status, body, "unsupported_image")


def damaged(png: bytes) -> bytes:
    """The PNG with its header whole and its pixel data zeroed (IDAT's length and CRC kept)."""
    start = png.index(b"IDAT") + 4
    length = int.from_bytes(png[start - 8:start - 4], "big")
    return png[:start] + b"\x00" * length + png[start + length:]


@pytest.mark.parametrize("field", ["image_b64", "image_path"])
async def test_an_image_whose_header_is_whole_but_pixels_do_not_decode_is_a_400(field: str, tmp_path: Path) -> None:
    broken = damaged(png_bytes(16, 16))
    check_image(broken)  # the header alone passes
    (tmp_path / "broken.png").write_bytes(broken)
    async with serve(make_settings(assets_dir=str(tmp_path), max_sessions_per_worker=1, queue_size=0)) as s:
        given = {"image_b64": base64.b64encode(broken).decode()} if field == "image_b64" else {"image_path": "broken.png"}
        status, body, _ = await s.create("ctl", **given)
        assert status == 400
        assert_error_body(status, body, "unreadable_image")
        assert body["detail"].startswith(f"{field}: ") and "does not decode" in body["detail"], body
        assert str(tmp_path) not in body["detail"] and "upload" not in body["detail"]
        assert not list(s.runtime.registry) and not s.runtime.runners  # nothing was admitted or stored
        assert s.runtime.uploads.path is None or not os.listdir(s.runtime.uploads.path)
        status, body, _ = await s.create("ctl2", image_b64=base64.b64encode(png_bytes(16, 16)).decode())
        assert status == 200, body  # the one slot was left free


async def test_an_image_bomb_in_the_assets_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bomb.png").write_bytes(png_header(50000, 50000))
    (tmp_path / "fine.png").write_bytes(png_bytes(8, 8))
    async with serve(make_settings(assets_dir=str(tmp_path))) as s:
        status, body, _ = await s.create("ctl", image_path="bomb.png")
        assert status == 400
        assert_error_body(status, body, "image_too_large")
        assert str(tmp_path) not in body["detail"]
        status, body, _ = await s.create("ctl2", image_path="fine.png")
        assert status == 200, body


async def test_creates_waiting_for_their_image_check_are_bounded_and_the_rest_told_to_retry() -> None:
    """Each create waiting for its image's decode holds its body: past MAX_DECODES_WAITING of them a create is a
    503 ``busy`` with Retry-After (they queued without bound, about 8 MiB each, one per open connection)."""
    from server.requests import DECODES_RETRY_AFTER, MAX_DECODES_WAITING

    image = base64.b64encode(png_bytes(16, 16)).decode()
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=MAX_DECODES_WAITING)) as s:
        decodes = s.runtime.image_decodes
        holders = [object() for _ in range(int(decodes.total_tokens))]
        for holder in holders:  # every decode slot busy: the creates below wait for one
            decodes.acquire_on_behalf_of_nowait(holder)
        answers: list[int] = []

        async def create(index: int) -> None:
            status, body, _ = await s.create(f"waiting-{index}", image_b64=image)
            answers.append(status)

        async with trio.open_nursery() as nursery:
            for index in range(MAX_DECODES_WAITING):
                nursery.start_soon(create, index)
            with trio.fail_after(20):
                while decodes.statistics().tasks_waiting < MAX_DECODES_WAITING:
                    await trio.sleep(0.01)  # bench-cost: the requests reach the limiter through the test client
            status, body, response = await s.create("one-too-many", image_b64=image)
            assert status == 503, body
            assert_error_body(status, body, "busy")
            assert response.headers["Retry-After"] == str(DECODES_RETRY_AFTER)
            for holder in holders:
                decodes.release_on_behalf_of(holder)
        assert sorted(answers) == [200] + [202] * (MAX_DECODES_WAITING - 1)  # the waiting ones were taken


async def test_an_image_path_that_is_a_loop_of_links_or_not_a_file_is_a_400_naming_it(tmp_path: Path) -> None:
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "folder.png").mkdir()
    async with serve(make_settings(assets_dir=str(tmp_path))) as s:
        for name, words in (("loop1", "loop of symbolic links"), ("pipe.png", "not a regular file"),
                            ("folder.png", "not a regular file")):
            status, body, _ = await s.create("ctl", image_path=name)
            assert status == 400, (name, body)  # a loop was a 500 with a traceback in the log
            assert_error_body(status, body, "invalid_image_path")
            assert words in body["detail"] and str(tmp_path) not in body["detail"], body
        assert not list(s.runtime.registry)


def test_an_image_swapped_for_a_pipe_or_a_link_after_it_was_named_is_not_read(tmp_path: Path) -> None:
    """What a create checked may be swapped before the session reads it: a pipe would hold the reader for ever,
    a link would be read wherever it points."""
    (tmp_path / "outside.png").write_bytes(png_bytes(8, 8))
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "link.png").symlink_to(tmp_path / "outside.png")
    for name in ("pipe.png", "link.png"):
        with pytest.raises(ValueError, match=f"image '{name}' cannot be read"):
            load_image(tmp_path / name, (64, 96))
    assert load_image(tmp_path / "outside.png", (64, 96)).shape == (8, 8, 3)


def test_a_decoded_image_is_never_larger_than_the_model_uses(tmp_path: Path) -> None:
    big, small = tmp_path / "big.png", tmp_path / "small.png"
    big.write_bytes(png_bytes(300, 200))
    small.write_bytes(png_bytes(12, 10))
    assert load_image(big, (64, 96)).shape == (64, 96, 3)
    assert load_image(small, (64, 96)).shape == (10, 12, 3)  # smaller images are kept as they are
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header(40000, 40000))
    with pytest.raises(ValueError, match="MAX_IMAGE_SIDE") as refused:
        load_image(bomb, (64, 96))
    assert str(tmp_path) not in str(refused.value)


@FUZZ_SETTINGS
@given(st.binary(max_size=64))
def test_the_header_reader_never_fails_on_garbage(data: bytes) -> None:
    try:
        info = check_image(data)
    except ImageRefused as exc:
        assert exc.reason in ("unsupported_image", "image_too_large")
    else:
        assert 1 <= info.width <= MAX_IMAGE_SIDE and 1 <= info.height <= MAX_IMAGE_SIDE


# -- principle 1: JSON depth on every HTTP parser ---------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
async def test_deep_json_bodies_are_a_400_on_every_json_route(depth: int) -> None:
    raw = ("[" * depth + "]" * depth).encode()
    async with serve() as s:
        created = await s.create("ctl")
        session_id = created[1]["session_id"]
        for path in (SESSIONS, f"{SESSIONS}/{session_id}/tokens"):
            status, body, _ = await s.json("post", path, data=raw, headers={"Content-Type": "application/json"})
            assert status == 400, (path, status, body)
            assert_error_body(status, body, "too_deep")
            assert str(MAX_JSON_DEPTH) in body["detail"]
        status, body, _ = await s.create("ctl2", config=nested(MAX_JSON_DEPTH + 2))
        assert status == 400 and body["error"] == "too_deep"
        # within the depth limit the body is read: the toy world itself then refuses the option it does not know
        status, body, _ = await s.create("ctl3", config=nested(MAX_JSON_DEPTH - 2))
        assert status == 400 and body["error"] == "invalid_option" and "'k'" in body["detail"], body


@pytest.mark.parametrize("shape", ["array", "object"])
async def test_a_body_of_more_json_values_than_any_request_holds_is_refused_before_it_is_parsed(shape: str) -> None:
    """8 MiB of ``[1,1,...]`` (or of keys) in a session's config took the server 2-3 s to parse, every session's
    stream stalling meanwhile, only to be refused for the config's size afterwards: it is refused on its count of
    values, read off its bytes; a body as large that holds an image (one string) is still read."""
    count = 4 * 1024 * 1024 // 4
    values = ",".join(["1"] * count) if shape == "array" else ",".join(f'"k{i}":0' for i in range(count // 8))
    config = f"[{values}]" if shape == "array" else f"{{{values}}}"
    raw = f'{{"identity": "ctl", "config": {{"x": {config}}}}}'.encode()
    async with serve() as s:
        status, body, _ = await s.json("post", SESSIONS, data=raw, headers={"Content-Type": "application/json"})
        assert_error_body(status, body, "too_many_values")
        assert f"at most {MAX_JSON_VALUES}" in body["detail"], body
        # as many bytes in one string (an image's place) parse: the pipeline then refuses what it is
        raw = b'{"identity": "ctl", "image": "data:image/png;base64,' + b"A" * len(raw) + b'"}'
        status, body, _ = await s.json("post", SESSIONS, data=raw, headers={"Content-Type": "application/json"})
        assert status == 400 and body["error"] != "too_many_values", body


@pytest.mark.parametrize(("shape", "refused_as"), [("unterminated", "invalid_json"), ("empty_strings", "too_many_values"),
                                                  ("escapes", "invalid_identity")])
async def test_a_body_of_strings_is_refused_in_one_scan(shape: str, refused_as: str) -> None:
    """The scan that steps over strings matched an unterminated one again from each later quote: 64 KB of ``\\"``
    pairs after an opening quote held the event loop 12 s, 1 MiB some 50 minutes. Now one scan: answered well within
    the deadline here (the loop is held while it runs, so a slow scan ends this test as soon as it returns). And 6 MiB
    of ``""`` (one value by the separators' count) cost a second of scanning: more quotes than its values could
    have refuses a document before its strings are looked at."""
    pairs = MAX_JSON_VALUES * 2 - 1000  # as many as the quote count lets through
    raw = {"unterminated": b'{"identity": "' + b'\\"' * pairs,
           "empty_strings": b"[" + b'""' * (3 * 1024 * 1024) + b"]",
           # one string of escaped backslashes: a regex step each, 8 MiB held the loop 0.3 s (one body of 16 at once)
           "escapes": b'{"identity": "' + b"\\\\" * (3 * 1024 * 1024) + b'"}'}[shape]
    async with serve() as s:
        with trio.fail_after(5):
            status, body, _ = await s.json("post", SESSIONS, data=raw, headers={"Content-Type": "application/json"})
        assert_error_body(status, body, refused_as)


@pytest.mark.parametrize("sign", ["", "-"])
async def test_an_integer_of_more_than_the_digit_limit_is_out_of_range_with_or_without_a_sign(sign: str) -> None:
    """MAX_INT_DIGITS digits are read (the toy world then refuses the number it cannot use); one more is a 400
    ``out_of_range`` before any parsing of it, a sign or none (an unsigned one got a digit more)."""
    async with serve() as s:
        for digits, error in ((MAX_INT_DIGITS, "invalid_option"), (MAX_INT_DIGITS + 1, "out_of_range")):
            raw = b'{"identity": "ctl", "config": {"chunks": %s%s}}' % (sign.encode(), b"9" * digits)
            status, body, _ = await s.json("post", SESSIONS, data=raw, headers={"Content-Type": "application/json"})
            assert status == 400 and body["error"] == error, (digits, body)
        assert list(s.runtime.registry) == []


# -- principle 7: identities and text ---------------------------------------------------------------


@pytest.mark.parametrize("identity", ["chunkline-worker-0", "chunkline-worker-7", "CHUNKLINE-Worker-0", "chunkline-"])
async def test_the_servers_identities_are_reserved(identity: str) -> None:
    async with serve() as s:
        status, body, _ = await s.create(identity)
        assert status == 400
        assert_error_body(status, body, "reserved_identity")
        session_id = (await s.create("ctl"))[1]["session_id"]
        status, body, _ = await s.json("post", f"{SESSIONS}/{session_id}/tokens", json={"identity": identity})
        assert status == 400
        assert_error_body(status, body, "reserved_identity")


@pytest.mark.parametrize(
    "fields",
    [{"prompt": "a lone \ud800 surrogate"}, {"config": {"note": "\udfff"}}, {"config": {"\ud83d": 1}}],
    ids=["prompt", "config-value", "config-key"],
)
async def test_unencodable_text_is_refused_up_front(fields: dict[str, Any]) -> None:
    raw = json.dumps({"identity": "ctl", **fields}).encode()  # json.dumps escapes the surrogate as \ud800
    async with serve() as s:
        status, body, _ = await s.json("post", SESSIONS, data=raw, headers={"Content-Type": "application/json"})
        assert status == 400
        assert_error_body(status, body, "unencodable_text")
        assert not list(s.runtime.registry)
        status, body, _ = await s.create("ctl", prompt="a proper pair \U0001f600 is fine")
        assert status == 200, body


# -- principle 1: viewer tokens per room -----------------------------------------------------------------


async def test_viewer_tokens_per_session_are_bounded() -> None:
    async with serve() as s:
        session_id = (await s.create("ctl"))[1]["session_id"]
        for index in range(MAX_VIEWERS_PER_SESSION):
            status, body, _ = await s.json("post", f"{SESSIONS}/{session_id}/tokens", json={"identity": f"v{index}"})
            assert status == 200, body
        status, body, _ = await s.json("post", f"{SESSIONS}/{session_id}/tokens", json={"identity": "one-too-many"})
        assert status == 409
        assert_error_body(status, body, "viewer_limit")
        assert str(MAX_VIEWERS_PER_SESSION) in body["detail"]
        status, body, _ = await s.json("post", f"{SESSIONS}/{session_id}/tokens", json={"identity": "v3"})
        assert status == 200, body  # an identity that already has a token may get a fresh one
        assert len(s.runtime.get(session_id).viewer_passes.until) == MAX_VIEWERS_PER_SESSION  # all it remembers


# -- principle 1: upload files ---------------------------------------------------------------------------


async def test_uploads_are_removed_with_their_session_and_the_folder_with_the_server() -> None:
    image = base64.b64encode(png_bytes(8, 8)).decode()
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=2)) as s:
        first = (await s.create("a", image_b64=image))[1]
        queued = (await s.create("b", image_b64=image))[1]
        refused = await s.create("c", image_b64=image)
        refused_again = await s.create("d", image_b64=image)
        assert (refused[0], refused_again[0]) == (202, 429)
        folder = s.runtime.uploads.path
        assert folder is not None and len(os.listdir(folder)) == 3
        await s.json("delete", f"{SESSIONS}/{queued['session_id']}")  # withdrawn from the queue
        await s.json("delete", f"{SESSIONS}/{first['session_id']}")  # ended while waiting for its controller
        await s.settle()
        assert len(os.listdir(folder)) == 1  # only the session promoted from the queue keeps its image
    assert not os.path.exists(folder), "the upload folder outlived the server"


# -- principle 4: the 429 during shutdown says so ---------------------------------------------------------


async def test_the_429_during_shutdown_says_shutting_down() -> None:
    async with serve(cleanup=False) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.runtime.shutdown, 1.0)
            await s.settle()
            status, body, response = await s.create("late")
        assert status == 429
        assert_error_body(status, body, "shutting_down")
        assert "shutting down" in body["detail"]
        assert int(response.headers["Retry-After"]) > 0


async def test_a_session_queued_at_shutdown_fails_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    """A queued session never ran and never will: shutdown fails it with why, not a quiet ``closed``, and its line
    counts it (it said `withdrawing queued ones`, however many)."""
    caplog.set_level(logging.INFO, "chunkline")
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=1), cleanup=False) as s:
        await s.create("holder")
        status, queued, _ = await s.create("waiting")
        assert status == 202 and queued["status"] == "queued"
        await s.runtime.shutdown(1.0)
        status, record, _ = await s.json("get", f"/v1/stream/sessions/{queued['session_id']}")
        assert status == 200 and record["status"] == "failed", record
        assert record["error"] == "the server shut down before the session could start"
        assert record["drain_cause"] == "shutdown"
        assert "shutting down: draining 1 live session(s), withdrawing 1 queued one(s) (grace 1 s)" in caplog.messages


# -- principle 8: no 500 on any route, static files included -----------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/static/%00",
        "/static/app.js%00.png",
        "/static/" + "a" * 300,
        "/static/" + "a/" * 2000 + "x",
        "/static/" + "b" * 5000,
        "/static/vendor/" + "c" * 256,
        "/static/..%2f..%2fetc%2fpasswd",
        "/static/%2e%2e/app.py",
        "/static/" + "%ff%fe" * 10,
    ],
)
async def test_static_paths_never_answer_5xx(path: str) -> None:
    async with serve() as s:
        status, body, response = await s.json("get", path)
        assert status == 404, (path, status, body)
        assert_error_body(status, body, "not_found")
        assert len(body["detail"]) < 200


async def test_fuzzed_static_paths_answer_200_or_404() -> None:
    async with serve() as s:

        @FUZZ_SETTINGS
        @given(st.text(min_size=1, max_size=600))
        def static(call: Any, name: str) -> None:
            from urllib.parse import quote

            status, body, _ = call(s.json, "get", "/static/" + quote(name, safe="/"))
            assert status in (200, 404), (name, status, body)

        await run_hypothesis_in_thread(lambda call: static(call))


# -- principle 4: a public error is a short reason, never a traceback or a server path ---------------------


async def test_a_failed_sessions_error_names_no_server_path(tmp_path: Path) -> None:
    from ..server.runner_fixtures import Peer, join

    (tmp_path / "street.png").write_bytes(png_bytes(16, 16))
    async with serve(make_settings(assets_dir=str(tmp_path))) as s:
        status, created, _ = await s.create("ctl", image_path="street.png")
        assert status == 200, created
        (tmp_path / "street.png").unlink()  # gone before the session begins: it fails naming the image
        async with join(s, created["room"], created["token"]) as ctl:
            errors = await ctl.wait_for(lambda p: p.status("error"), "the session's error", timeout=20)
        status, body, _ = await s.json("get", f"{SESSIONS}/{created['session_id']}")
        assert body["status"] == "failed"
        for text in (body["error"], errors[0]["detail"]):
            assert "'street.png' does not exist" in text, text
            assert "/" not in text and "Traceback" not in text and "\n" not in text, text
            assert len(text) <= 240
        assert isinstance(ctl, Peer)


async def test_a_web_page_of_another_origin_cannot_make_a_visitors_browser_change_anything() -> None:
    """A page anywhere could make its visitor's browser POST here without asking first (a form, a ``text/plain``
    body): with no API key, it created sessions and drained the only worker. Such a request names its page in
    ``Origin``: a 403 unless the page is this server's own or one ``--cors-allow-origins`` names; nothing changes."""
    page_elsewhere = {"Origin": "http://pages.example", "Content-Type": "text/plain", "Host": "127.0.0.1:8088"}
    own_page = {"Origin": "http://127.0.0.1:8088", "Host": "127.0.0.1:8088"}
    async with serve() as s:
        drain = f"/v1/service/workers/{s.worker_id}/drain"
        for path, data in ((SESSIONS, b'{"identity": "ctl"}'), (drain, b'{"deadline_seconds": 1}')):
            status, body, _ = await s.json("post", path, data=data, headers=page_elsewhere)
            assert_error_body(status, body, "forbidden_origin")
            assert status == 403 and "'http://pages.example'" in body["detail"], body
        assert list(s.runtime.registry) == []
        assert s.runtime.ready  # the worker was not drained
        status, created, _ = await s.json("post", SESSIONS, json={"identity": "ctl"}, headers=own_page)
        assert status == 200, created
        path = f"{SESSIONS}/{created['session_id']}"
        assert (await s.json("delete", path, headers=page_elsewhere))[0] == 403
        assert (await s.json("get", path))[1]["status"] != "closed"
        assert (await s.json("delete", path, headers=own_page))[0] == 200  # a script or curl sends no Origin at all
        # a page at another port of this host (a Host without a port is the scheme's own), and a page at a name of
        # its own that its author points at this host (DNS rebinding: Host then names it too, as the page's own)
        for origin, host in (("http://127.0.0.1:3000", "127.0.0.1"), ("http://rebound.example:8088", "rebound.example:8088")):
            status, body, _ = await s.json("post", SESSIONS, json={"identity": "ctl"}, headers={"Origin": origin, "Host": host})
            assert status == 403 and body["error"] == "forbidden_origin", (origin, body)
        assert "not 'rebound.example'" in body["detail"], body
        # two Origin fields, the page's own first: the second was not looked at
        both = Headers([("Origin", own_page["Origin"]), ("Origin", "http://pages.example"), ("Host", "127.0.0.1:8088")])
        status, body, _ = await s.json("post", SESSIONS, json={"identity": "ctl"}, headers=both)
        assert status == 403 and body["error"] == "forbidden_origin", body
    async with serve(make_settings(cors_allow_origins=("http://pages.example",))) as s:
        status, created, _ = await s.json("post", SESSIONS, data=b'{"identity": "ctl"}', headers=page_elsewhere)
        assert status == 200, created
    async with serve(make_settings(api_key="a-key")) as s:
        # with an API key a rebound page cannot use the API anyway, so a server's own name is any name
        headers = {"Origin": "http://rebound.example:8088", "Host": "rebound.example:8088", "Authorization": "Bearer a-key"}
        assert (await s.json("post", SESSIONS, json={"identity": "ctl"}, headers=headers))[0] == 200


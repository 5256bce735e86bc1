"""What a refusal repeats of the request is bounded: an id, a query value, a field name or a file name the
client sent comes back quoted and cut to ``MAX_ECHO`` characters, with its full length named, through a
real server (front, hypercorn, sockets). A 404 for an unknown session echoed the whole requested id (about
15 KB, as long as the front's head bound allows), and a body of many unknown fields named every one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from server.reasons import MAX_ECHO, echo, echo_each

from .test_hostile_server import running

LONG = "a" * 15000
IMAGE_REPLAY = str(Path(__file__).parents[1] / "server" / "image_replay.py")
#: an error body that repeats cut echoes (at most MAX_ECHOED of them), with the fixed text around them
MOST_BYTES = 1024


def test_echo_quotes_short_text_and_cuts_long_text_naming_its_length() -> None:
    assert echo("abc") == "'abc'"
    assert echo(b"ab") == "b'ab'"
    assert echo(LONG) == f"{'a' * MAX_ECHO!r}... (15000 characters in all)"
    assert echo(b"\x00" * 100).endswith("... (100 bytes in all)")
    assert echo(list(range(1000))).endswith("characters in all)") and len(echo(list(range(1000)))) < 2 * MAX_ECHO
    assert echo_each(["x", "y"]) == "'x', 'y'"
    assert echo_each([str(i) for i in range(12)]) == "'0', '1', '2', '3', '4' and 7 more"


def _assert_cut(status: int, body: Any, expected: int) -> None:
    assert status == expected, (status, body)
    assert set(body) == {"error", "detail"}, body
    assert len(json.dumps(body)) < MOST_BYTES, f"{len(json.dumps(body))} bytes: {body['detail'][:200]}"
    assert "characters in all)" in body["detail"] or " more" in body["detail"], body


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("GET", f"/v1/stream/sessions/{LONG}", None, 404),
    ("DELETE", f"/v1/stream/sessions/{LONG}", None, 404),
    ("POST", f"/v1/stream/sessions/{LONG}/tokens", {"identity": "v"}, 404),
    ("GET", f"/v1/stream/sessions?status={LONG}", None, 400),
    ("POST", f"/v1/service/workers/{LONG}/drain", None, 404),
    ("POST", "/v1/stream/sessions", {"identity": "c", **{f"{i}{LONG[:2000]}": 1 for i in range(40)}}, 400),
], ids=["get-session", "delete-session", "viewer-token", "status-filter", "drain-worker", "unknown-fields"])
async def test_a_refusal_repeats_client_text_only_cut_short(method: str, path: str, body: Any, status: int) -> None:
    async with running() as server:
        answer_status, answer = await server.request(method, path, body)
    _assert_cut(answer_status, answer, status)


@pytest.mark.parametrize(("name", "why"), [
    ("b" * 200, "does not exist in the assets directory"),
    ("b" * 4000, "has a part of 4000 bytes; a file or folder name is at most 255"),  # too long: was a 500
], ids=["missing", "too-long-a-name"])
async def test_an_image_path_that_is_not_there_is_refused_and_named_cut_short(tmp_path: Path, name: str, why: str) -> None:
    # a replay that takes an image (the replay pipeline itself refuses any image_path before it is looked up)
    async with running(assets_dir=str(tmp_path), pipeline=IMAGE_REPLAY) as server:
        status, answer = await server.request("POST", "/v1/stream/sessions", {"identity": "c", "image_path": name})
    _assert_cut(status, answer, 400)
    assert answer["detail"].startswith("image_path 'bbbb") and why in answer["detail"], answer

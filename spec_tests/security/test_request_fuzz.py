"""Hypothesis against every request the HTTP API reads: bodies, query strings and path segments.

One started app (capacity 2, a queue of 2, request bodies up to 4 KiB, an assets directory) with a tiny
in-test service serves every example (see :func:`helpers.run_hypothesis_in_thread`). Whatever an example
sends, the answer is one of :data:`helpers.ALLOWED_STATUSES` — never a 5xx — every refusal is exactly
``{"error", "detail"}`` JSON with a non-empty detail, and afterwards the runtime's invariants hold (no record
left ``pending``, no more retained sessions than capacity, the queue within ``queue_size``). Sessions an
example creates are deleted (through the API) before the next one, so capacity stays free.

Targeted cases ride along: bodies over ``--max-body-bytes`` (413), malformed JSON (400 ``invalid_json``),
unknown fields (400 ``unknown_field``, as documented in server/requests.py) and path traversal through
``image_path`` (400 ``invalid_image_path``).
"""

from __future__ import annotations

import base64
import json
import string
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_from_bytes

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec_tests.server.conftest import png_bytes
from spec_tests.server.runner_fixtures import CounterService, Served, serve, settings

from .helpers import (
    FUZZ_SETTINGS,
    assert_error_body,
    check_response,
    check_runtime_invariants,
    run_hypothesis_in_thread,
)

SESSIONS = "/v1/stream/sessions"
MAX_BODY = 4096
CREATE_FIELDS = ["identity", "role", "prompt", "image_path", "image_b64", "config"]
TOKEN_FIELDS = ["identity", "role"]
IDENTITY_ALPHABET = string.ascii_letters + string.digits + "_.:@-"

# -- strategies ----------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities too: Python's json writes and reads them
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)
identities = st.text(IDENTITY_ALPHABET, min_size=1, max_size=130) | st.text(max_size=20)
traversals = st.sampled_from(
    [
        "../outside.png",
        "../../etc/passwd",
        "/etc/passwd",
        "sub/../../outside.png",
        "escape.png",  # a symlink out of the assets directory
        "..\\outside.png",
        "scene.png\x00.txt",
        "sub/../scene.png",
        "./../outside.png",
        "",
        ".",
        "sub",
        "scene.png",  # the one valid path
        "sub/deep.png",
        "inside_link.png",
    ]
)
base64_texts = st.binary(min_size=0, max_size=64).map(lambda b: base64.b64encode(b).decode()) | st.text(max_size=30)


def field_values(name: str) -> st.SearchStrategy[Any]:
    """Values near the valid ones for a known field, plus anything at all."""
    near: dict[str, st.SearchStrategy[Any]] = {
        "identity": identities,
        "role": st.sampled_from(["controller", "viewer", "worker", "", "Controller"]),
        "prompt": st.text(max_size=50) | st.just("x" * 2001),
        "image_path": traversals | st.text(max_size=30),
        "image_b64": base64_texts,
        "config": st.dictionaries(st.text(max_size=8), json_values, max_size=4) | st.just({"big": "x" * 17000}),
    }
    return near[name] | json_values


def objects(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects made of known fields (with values near and far from valid) and sometimes unknown ones."""
    known = st.fixed_dictionaries({}, optional={name: field_values(name) for name in fields})
    extra = st.dictionaries(st.text(max_size=12).filter(lambda k: k not in fields), json_values, max_size=2)
    return st.tuples(known, st.one_of(st.just({}), extra)).map(lambda pair: {**pair[0], **pair[1]})


PNG_B64 = base64.b64encode(png_bytes()).decode()

valid_creates = st.fixed_dictionaries(
    {"identity": st.text(IDENTITY_ALPHABET, min_size=1, max_size=128)},
    optional={
        "role": st.just("controller"),
        "prompt": st.none() | st.text(max_size=60),
        "image_path": st.sampled_from(["scene.png", "sub/deep.png", "inside_link.png"]),
        "image_b64": st.just(PNG_B64) | st.binary(min_size=1, max_size=40).map(lambda b: base64.b64encode(b).decode()),
        "config": st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    },
)
valid_tokens = st.fixed_dictionaries(
    {"identity": st.text(IDENTITY_ALPHABET, min_size=1, max_size=128)}, optional={"role": st.just("viewer")}
)


def request_bodies(fields: list[str]) -> st.SearchStrategy[bytes]:
    """Raw bodies: valid ones, JSON objects near the schema, any JSON value, arbitrary bytes, broken and
    oversized JSON."""
    valid = valid_creates if "config" in fields else valid_tokens
    as_json = st.one_of(valid, objects(fields), objects(fields), json_values).map(lambda v: json.dumps(v).encode())
    broken = st.sampled_from([b"{", b"{\"identity\": }", b"[1, 2", b"\xff\xfe{}", b"NaN", b"{\"identity\": \"a\",}",
                              b"\"unterminated", b"{'identity': 'a'}", b"", b" ", b"null", b"\x00"])
    oversized = st.integers(MAX_BODY + 1, MAX_BODY * 3).map(
        lambda n: json.dumps({"identity": "big", "prompt": "p" * n}).encode()
    )
    return st.one_of(as_json, as_json, st.binary(max_size=200), broken, oversized)


session_ids = st.text(min_size=1, max_size=40) | st.sampled_from(
    ["..", ".", "%2e%2e", "..%2f..%2fopenapi.json", "a/b", "%00", "\x00", " ", "?", "#", "%", "nope"]
)

# -- the app -------------------------------------------------------------------------------------


@asynccontextmanager
async def fuzz_app(assets: Path) -> AsyncIterator[tuple[Served, str]]:
    """The app, and one long-lived session whose token route the examples hit."""
    config = settings(max_sessions_per_worker=2, queue_size=2, max_body_bytes=MAX_BODY, assets_dir=str(assets))
    async with serve(config, CounterService()) as served:
        status, body = await served.json("post", SESSIONS, json={"identity": "resident"})
        assert status == 200, body
        yield served, body["session_id"]


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    root = tmp_path / "assets"
    (root / "sub").mkdir(parents=True)
    (root / "scene.png").write_bytes(png_bytes())
    (root / "sub" / "deep.png").write_bytes(png_bytes())
    (tmp_path / "outside.png").write_bytes(png_bytes())
    (root / "escape.png").symlink_to(tmp_path / "outside.png")
    (root / "inside_link.png").symlink_to(root / "scene.png")
    return root


async def send(served: Served, method: str, path: str, **kwargs: Any) -> tuple[int, bytes, Any]:
    response = await getattr(served.client, method)(path, **kwargs)
    return response.status_code, await response.get_data(), response.headers


async def cleanup(served: Served, resident: str, *, keep: bool = False) -> None:
    """Delete (through the API) every live session but the resident one, then check the invariants.

    ``keep`` leaves this example's sessions in place (the next examples then meet a full worker and a
    full queue: 202 and 429); they are deleted by the first example that does not keep.
    """
    check_runtime_invariants(served.runtime)
    for record in list(served.runtime.registry) if not keep else []:
        if record.session_id != resident and not record.is_terminal:
            status, raw, headers = await send(served, "delete", f"{SESSIONS}/{record.session_id}")
            body = check_response(status, raw, headers.get("Content-Type"), "DELETE during cleanup")
            assert status == 200 and body["status"] in {"closed", "failed", "expired"}, (status, body)
    check_runtime_invariants(served.runtime)
    assert not served.runtime.get(resident).is_terminal


# -- the fuzz tests ---------------------------------------------------------------------------------


async def test_create_session_bodies_never_crash(assets: Path) -> None:
    async with fuzz_app(assets) as (served, resident):

        async def example(raw: bytes, keep: bool) -> None:
            status, answer, headers = await send(
                served, "post", SESSIONS, data=raw, headers={"Content-Type": "application/json"}
            )
            what = f"POST {SESSIONS} {raw[:200]!r}"
            body = check_response(status, answer, headers.get("Content-Type"), what)
            if len(raw) > MAX_BODY:
                assert status == 413, what
            if status in (200, 202):
                sent = json.loads(raw)
                assert isinstance(sent, dict) and set(sent) <= set(CREATE_FIELDS), what
                assert body["status"] == ("assigned" if status == 200 else "queued") and body["token"], body
            if status == 429:
                assert int(headers["Retry-After"]) > 0, what
            await cleanup(served, resident, keep=keep)

        @FUZZ_SETTINGS
        @given(raw=request_bodies(CREATE_FIELDS), keep=st.booleans())
        def fuzz(call: Any, raw: bytes, keep: bool) -> None:
            call(example, raw, keep)

        await run_hypothesis_in_thread(fuzz)


async def test_token_request_bodies_never_crash(assets: Path) -> None:
    async with fuzz_app(assets) as (served, resident):
        path = f"{SESSIONS}/{resident}/tokens"

        async def example(raw: bytes) -> None:
            status, answer, headers = await send(
                served, "post", path, data=raw, headers={"Content-Type": "application/json"}
            )
            what = f"POST {path} {raw[:200]!r}"
            body = check_response(status, answer, headers.get("Content-Type"), what)
            assert status in {200, 400, 409, 413}, what
            if status == 200:
                assert body["role"] == "viewer" and body["session_id"] == resident, body
                verified = served.runtime.issuer.verify(body["token"], room=body["room"])
                assert (verified.role, verified.can_publish_data) == ("viewer", False)
            await cleanup(served, resident)

        @FUZZ_SETTINGS
        @given(raw=request_bodies(TOKEN_FIELDS))
        def fuzz(call: Any, raw: bytes) -> None:
            call(example, raw)

        await run_hypothesis_in_thread(fuzz)


async def test_list_status_query_never_crashes(assets: Path) -> None:
    async with fuzz_app(assets) as (served, resident):

        async def example(status_value: str | None, raw_query: bytes | None) -> None:
            if raw_query is not None:
                path = f"{SESSIONS}?" + quote_from_bytes(raw_query, safe="=&;%+")
                status, answer, headers = await send(served, "get", path)
            else:
                path = f"{SESSIONS}?status={status_value!r}"
                status, answer, headers = await send(served, "get", SESSIONS, query_string={"status": status_value})
            body = check_response(status, answer, headers.get("Content-Type"), f"GET {path}")
            assert status in {200, 400}, path
            if status == 200:
                assert isinstance(body["sessions"], list)
            await cleanup(served, resident)

        @FUZZ_SETTINGS
        @given(
            status_value=st.text(max_size=30) | st.sampled_from(["running", "joining_room", "RUNNING", "pending "]),
            raw_query=st.none() | st.binary(max_size=60),
        )
        def fuzz(call: Any, status_value: str, raw_query: bytes | None) -> None:
            call(example, status_value, raw_query)

        await run_hypothesis_in_thread(fuzz)


async def test_session_id_path_segments_never_crash(assets: Path) -> None:
    async with fuzz_app(assets) as (served, resident):

        async def example(segment: str, method: str, raw: bytes) -> None:
            encoded = quote(segment, safe="") if segment not in ("..", ".") else segment
            path = f"{SESSIONS}/{encoded}" + ("/tokens" if method == "tokens" else "")
            kwargs: dict[str, Any] = {}
            if method == "tokens":
                kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}}
            verb = {"get": "get", "delete": "delete", "tokens": "post"}[method]
            status, answer, headers = await send(served, verb, path, **kwargs)
            what = f"{verb.upper()} {path}"
            check_response(status, answer, headers.get("Content-Type"), what)
            if segment != resident:
                assert status in {400, 404, 413}, what  # no such session: never 200, never a crash
            await cleanup(served, resident)

        @FUZZ_SETTINGS
        @given(
            segment=session_ids | st.just(resident),
            method=st.sampled_from(["get", "delete", "tokens"]),
            raw=st.sampled_from([b'{"identity": "viewer-x"}', b"{", b"[]", b'{"identity": "resident"}']),
        )
        def fuzz(call: Any, segment: str, method: str, raw: bytes) -> None:
            if method == "delete" and segment == resident:
                method = "get"  # keep the resident session for the other examples
            call(example, segment, method, raw)

        await run_hypothesis_in_thread(fuzz)


# -- the documented refusals, one by one -------------------------------------------------------------


async def test_oversized_bodies_get_413(assets: Path) -> None:
    async with fuzz_app(assets) as (served, resident):
        big = json.dumps({"identity": "big", "prompt": "p" * (MAX_BODY + 1)}).encode()
        for path in (SESSIONS, f"{SESSIONS}/{resident}/tokens"):
            status, raw, _ = await send(served, "post", path, data=big, headers={"Content-Type": "application/json"})
            assert status == 413, (path, raw)
            assert_error_body(status, raw)
        # exactly at the limit is read (and refused for its content, not its size)
        head, tail = b'{"identity": "a", "prompt": "', b'"}'
        at_limit = head + b"p" * (MAX_BODY - len(head) - len(tail)) + tail
        assert len(at_limit) == MAX_BODY
        status, raw, _ = await send(served, "post", SESSIONS, data=at_limit, headers={"Content-Type": "application/json"})
        assert status in (200, 202, 400), raw
        await cleanup(served, resident)


@pytest.mark.parametrize(
    "raw",
    [b"{", b"{\"identity\": \"a\",}", b"\xff\xfe\x00", b"{'identity': 'a'}", b"[1,", b"\"open"],
)
async def test_malformed_json_gets_400_invalid_json(assets: Path, raw: bytes) -> None:
    async with fuzz_app(assets) as (served, resident):
        for path in (SESSIONS, f"{SESSIONS}/{resident}/tokens"):
            status, answer, _ = await send(served, "post", path, data=raw, headers={"Content-Type": "application/json"})
            assert status == 400, (path, answer)
            assert assert_error_body(status, answer)["error"] == "invalid_json"
        check_runtime_invariants(served.runtime)


async def test_unknown_fields_are_refused_naming_them(assets: Path) -> None:
    async with fuzz_app(assets) as (served, resident):
        status, raw, _ = await send(served, "post", SESSIONS, json={"identity": "a", "imagepath": "scene.png"})
        body = assert_error_body(status, raw)
        assert (status, body["error"]) == (400, "unknown_field") and "imagepath" in body["detail"]
        status, raw, _ = await send(served, "post", f"{SESSIONS}/{resident}/tokens", json={"identity": "v", "can_publish": True})
        body = assert_error_body(status, raw)
        assert (status, body["error"]) == (400, "unknown_field") and "can_publish" in body["detail"]
        assert len([r for r in served.runtime.registry if not r.is_terminal]) == 1


@pytest.mark.parametrize(
    "image_path",
    ["../outside.png", "../../../../etc/passwd", "/etc/passwd", "sub/../../outside.png", "escape.png",
     "..\\outside.png", "scene.png\x00", "sub/../../assets/../outside.png", "%2e%2e/outside.png", "missing.png",
     "sub", "."],
)
async def test_image_path_traversal_gets_400(assets: Path, image_path: str) -> None:
    async with fuzz_app(assets) as (served, resident):
        before = len(list(served.runtime.registry))
        status, raw, _ = await send(served, "post", SESSIONS, json={"identity": "a", "image_path": image_path})
        body = assert_error_body(status, raw)
        assert (status, body["error"]) == (400, "invalid_image_path"), (image_path, body)
        assert str(assets.parent) not in body["detail"], "the refusal leaks a server path"
        assert len(list(served.runtime.registry)) == before  # nothing was created
        check_runtime_invariants(served.runtime)


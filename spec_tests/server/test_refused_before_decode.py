"""A create the server would refuse anyway is refused before its image is decoded or its options are checked.

The decode of an uploaded or named image takes up to some hundreds of ms of CPU (a large flat PNG), and the check
of the options a round trip to a worker: a create refused with 429 (the queue full, no queue, the server shutting
down) or 503 (no worker at all) paid for both first, so any client could make the server decode images for
nothing. The admission book says whether a session could be taken or queued now; when it could not, the answer
is the one the create gets without an image (the same status, body and Retry-After), and an image whose pixel data
is damaged is a 429, not a 400: the refusal the server already knows wins over a problem it would have to decode
the image to find. The request's own problems that cost nothing to find (its fields, the image's header, an
image path outside the assets) are still a 400 first; a create that would be taken still has its image decoded
(a damaged one is a 400 naming it, as before).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import trio

from pipelines.toy_world import ToyWorldConfig, ToyWorldService
import server.requests
from server import option_check

from .conftest import assert_error_body, failing_loader, make_settings, png_bytes, serve, wait_worker_failed

SESSIONS = "/v1/stream/sessions"


def damaged(png: bytes) -> bytes:
    """The PNG with its header whole and its pixel data zeroed: only a decode finds it broken."""
    start = png.index(b"IDAT") + 4
    length = int.from_bytes(png[start - 8:start - 4], "big")
    return png[:start] + b"\x00" * length + png[start + length:]


BROKEN = damaged(png_bytes(16, 16))
BROKEN_B64 = base64.b64encode(BROKEN).decode()


class Spent:
    """The decodes and option checks the server ran, counted where the create route calls them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decodes = 0
        self.option_checks = 0
        decode, check = server.requests.check_decodes, option_check.check_options

        def counted_decode(source: Any) -> None:
            self.decodes += 1  # one create's decode at a time here: no two threads count at once
            decode(source)

        async def counted_check(runtime: Any, options: dict[str, Any], image: Any = None) -> None:
            self.option_checks += 1
            await check(runtime, options, image)

        monkeypatch.setattr(server.requests, "check_decodes", counted_decode)
        monkeypatch.setattr(option_check, "check_options", counted_check)

    @property
    def both(self) -> tuple[int, int]:
        return self.decodes, self.option_checks


def _same_refusal(status: int, body: Any, response: Any, expected: tuple[int, Any, Any]) -> None:
    assert (status, body) == expected[:2], (status, body, expected[:2])
    assert response.headers.get("Retry-After") == expected[2].headers.get("Retry-After")


@pytest.mark.parametrize(("queue_size", "reason"), [(0, "no_capacity"), (1, "queue_full")])
@pytest.mark.parametrize("field", ["image_b64", "image_path"])
async def test_a_create_refused_for_room_is_refused_before_its_image_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queue_size: int, reason: str, field: str
) -> None:
    (tmp_path / "broken.png").write_bytes(BROKEN)
    image = {"image_b64": BROKEN_B64} if field == "image_b64" else {"image_path": "broken.png"}
    spent = Spent(monkeypatch)
    settings = make_settings(max_sessions_per_worker=1, queue_size=queue_size, assets_dir=str(tmp_path))
    async with serve(settings) as s:
        taken = [(await s.create(f"holder-{i}"))[1]["session_id"] for i in range(1 + queue_size)]  # slot and queue
        assert spent.both == (0, 1 + queue_size)
        plain = await s.create("no-image")
        assert plain[0] == 429
        assert_error_body(429, plain[1], reason)
        spent.option_checks = 0
        status, body, response = await s.create("broken", **image)
        _same_refusal(status, body, response, plain)  # not the 400 unreadable_image a decode would find
        status, body, response = await s.create("bad-option", config={"resolution": "abc"}, **image)
        _same_refusal(status, body, response, plain)  # not the 400 invalid_option a check would find
        assert spent.both == (0, 0), "a create the book refused had its image decoded or its options checked"
        assert len(list(s.runtime.registry)) == len(taken)  # nothing of the refused ones is kept
        # the request's own problems that cost nothing to find still come first
        status, body, _ = await s.create("outside", image_path="../broken.png")
        assert status == 400 and body["error"] == "invalid_image_path", body
        # with room again, the same image is decoded and refused for what it is
        await s.json("delete", f"{SESSIONS}/{taken[-1]}")
        await s.settle()
        status, body, _ = await s.create("broken-again", **image)
        assert status == 400, body
        assert_error_body(status, body, "unreadable_image")
        assert spent.both == (1, 0)  # the decode refused it: the options were never asked about
        status, body, _ = await s.create("fine", image_b64=base64.b64encode(png_bytes(16, 16)).decode())
        assert status in (200, 202), body
        assert spent.both == (2, 1)


async def test_a_create_during_shutdown_is_refused_before_its_image_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    spent = Spent(monkeypatch)
    async with serve(cleanup=False) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.runtime.shutdown, 1.0)
            await s.settle()
            plain = await s.create("late")
            status, body, response = await s.create("late-with-image", image_b64=BROKEN_B64)
        assert_error_body(plain[0], plain[1], "shutting_down")
        _same_refusal(status, body, response, plain)
        assert spent.decodes == 0


async def test_health_says_the_server_is_shutting_down_and_takes_no_create_meanwhile() -> None:
    """While the server drains to stop, health says so and counts no free slot: it said ``free_slots: 1`` (and
    ``healthy``) while every create was a 429 ``shutting_down``, so a balancer reading it sent creates on."""
    async with serve(make_settings(max_sessions_per_worker=2), cleanup=False) as s:
        status, body, _ = await s.json("get", "/v1/stream/health")
        assert (body["shutting_down"], body["free_slots"]) == (False, 2), body
        created = await s.create("live")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.runtime.shutdown, 1.0)
            await s.settle()
            status, body, _ = await s.json("get", "/v1/stream/health")
            assert (status, body["shutting_down"], body["free_slots"]) == (200, True, 0), body
            assert_error_body(*(await s.create("late"))[:2], "shutting_down")
        assert created[0] == 200, created


async def test_a_create_with_no_worker_to_run_it_is_refused_before_its_image_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spent = Spent(monkeypatch)
    async with serve(make_settings(queue_size=2), loader=failing_loader, ready=False) as s:
        await wait_worker_failed(s.runtime)
        assert not s.runtime.book.can_place()
        plain = await s.create("nobody-runs-it")
        assert_error_body(plain[0], plain[1], "no_worker")
        status, body, response = await s.create("nobody-runs-it-either", image_b64=BROKEN_B64)
        _same_refusal(status, body, response, plain)
        assert spent.decodes == 0


class MuteCheckWorld(ToyWorldService):
    """Its option check waits until the test lets it go: a create with options waits on it meanwhile."""

    def __init__(self, asked: trio.Event) -> None:
        super().__init__(ToyWorldConfig(height=32, width=48, frames_per_chunk=2), max_sessions=2)
        self.asked = asked

    async def check_options(self, options: Any) -> None:
        self.asked.set()
        await trio.sleep_forever()


async def test_a_create_waiting_for_its_check_when_the_stop_begins_is_refused_shutting_down_at_once() -> None:
    """A create whose options' check is still under way (here one that never answers) when the server begins to
    stop is answered 429 ``shutting_down`` at once, as a create arriving then is. It waited for the check's own 10 s
    deadline (an image's decode likewise), past the front's 5 s grace for answers, and could be cut off unanswered."""
    asked = trio.Event()
    async with serve(loader=lambda path, **_: MuteCheckWorld(asked), cleanup=False) as s:
        answers: list[tuple[int, Any, Any]] = []

        async def create_with_options() -> None:
            answers.append(await s.create("waits-for-its-check", config={"fps": 8}))

        with trio.fail_after(5):  # the check's own deadline is 10 s: the stop must answer it first
            async with trio.open_nursery() as nursery:
                nursery.start_soon(create_with_options)
                await asked.wait()
                nursery.start_soon(s.runtime.shutdown, 1.0)
        ((status, body, _),) = answers
        assert_error_body(status, body, "shutting_down")
        assert list(s.runtime.registry) == []  # nothing of it was kept

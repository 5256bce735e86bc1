"""A create's session options are checked by the pipeline itself before the server holds anything.

A refused option is an HTTP 400 ``invalid_option`` naming it, in every worker mode: in-process (the
app's own worker), ``local-agents`` (the pipeline in an agent process, asked over the agent's
connection) and process workers (the pipeline in a service child, asked through its proxy). Nothing
is held: a one-slot server with no queue takes the next valid create at once.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

import httpx

import pytest
import trio

from pipelines.contract import SessionConfig
from pipelines.loader import load_service
from pipelines.replay import ReplayService
from server import option_check
from server.log_pace import LOG_BURST
from server.process_service import start_process_service

from ..virtual_time import elapse
from . import runner_fixtures
from .conftest import GatedLoader, assert_error_body, make_settings, serve
from .http_served import AgentApp
from .runner_fixtures import CounterService, wait_until

SESSIONS = "/v1/stream/sessions"

#: (options, the words the refusal must hold): bad values, bounds, an unknown name, wrong types
BAD_OPTIONS: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"resolution": "abc"}, ("'resolution'", '"abc"')),
    ({"resolution": "4000x4000"}, ("'resolution'", "4000")),
    ({"resolution": "322x192"}, ("'resolution'", "multiple of 4")),
    ({"resolutoin": "320x192"}, ("unknown option", "resolutoin")),
    ({"chunks": "three"}, ("'chunks'", '"three"')),
    ({"chunks": 0}, ("'chunks'",)),
    # past the engine's sequence ids: taken once, and the session failed with the engine's words when it began
    ({"chunks": 2**63 + 1}, ("'chunks'", "1..2**63", str(2**63 + 1))),
    ({"chunks": 10**30}, ("'chunks'", "1..2**63")),
    ({"chunks": None}, ("'chunks'", "got null")),  # JSON's word (it said None); leave it out for no end, as `continuous` is left out for its default
    ({"resolution": "\uff11\uff16\uff10x96"}, ("'resolution'",)),  # full-width digits are not digits here
    ({"continuous": "yes"}, ("'continuous'", '"yes"')),
    # the startup check's own option once, read nowhere: a client's took any value and did nothing
    ({"preview": "anything"}, ("unknown option", "'preview'")),
]


async def assert_refused(s: Any, options: dict[str, Any], words: tuple[str, ...]) -> None:
    status, body, *_ = await s.json("post", SESSIONS, json={"identity": "ctl", "config": options})
    assert status == 400, (options, status, body)
    assert_error_body(status, body, "invalid_option")
    for word in words:
        assert word in body["detail"], (options, body)
    assert not [r for r in s.runtime.registry if not r.is_terminal], "a refused create left a record"


async def test_a_bad_option_is_a_400_naming_it_and_holds_nothing(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=0), workers=worker_kind) as s:
        for options, words in BAD_OPTIONS:
            await assert_refused(s, options, words)
        assert not list(s.runtime.registry)
        assert s.runtime.health()["free_slots"] == 1
        # the one slot is still free: a valid create (with options the pipeline takes) gets it
        status, body, _ = await s.create("ctl", config={"resolution": "320x192", "chunks": 4})
        assert status == 200, body
        assert body["token"] and body["worker_id"] == s.worker_id
        # and with that slot taken and no queue, the next create is the usual 429, not a 400
        status, body, _ = await s.create("ctl-2", config={"continuous": True})
        assert status == 429, body


async def test_options_are_checked_in_the_process_worker_and_the_slot_stays_free():
    loader = functools.partial(start_process_service, height=32, width=48, frames_per_chunk=2)
    settings = runner_fixtures.settings(pipeline="pipelines/toy_world", worker_mode="process",
                                        max_sessions_per_worker=1, queue_size=0)
    async with runner_fixtures.serve(settings, loader, ready=False) as s:
        await wait_until(lambda: s.runtime.ready, "the service child", deadline=120)
        for options, words in (({"resolution": "abc"}, ("'resolution'", '"abc"')),
                               ({"colour": "red"}, ("unknown option", "colour"))):
            status, body = await s.json("post", SESSIONS, json={"identity": "ctl", "config": options})
            assert status == 400 and body["error"] == "invalid_option", body
            assert all(word in body["detail"] for word in words), body
            assert "Traceback" not in body["detail"] and "RemoteServiceError" not in body["detail"]
        assert not list(s.runtime.registry) and s.free_slots() == 1
        created = await s.create("ctl", config={"resolution": "64x48"})
        assert created["status"] == "assigned", created


async def test_a_pipeline_that_declares_no_check_takes_any_options():
    """The contract's default ``check_options`` takes everything: such a pipeline works as before."""
    async with runner_fixtures.serve(runner_fixtures.settings(), CounterService()) as s:
        created = await s.create("ctl", config={"anything": [1, 2], "resolution": "abc"})
        assert created["status"] == "assigned", created


async def test_options_while_every_worker_is_loading_are_a_503_and_hold_nothing():
    loader = GatedLoader()
    async with serve(make_settings(), loader=loader, ready=False) as s:
        try:
            status, body, response = await s.create("ctl", config={"resolution": "abc"})
            assert status == 503, body
            assert_error_body(status, body, "no_worker")
            assert "check the session's options" in body["detail"]
            assert int(response.headers["Retry-After"]) > 0
            assert not list(s.runtime.registry)
            # no options, with no worker ready to check them: taken as before (the pipeline checks them at start)
            status, body, _ = await s.create("ctl-plain")
            assert status == 202 and body["status"] == "queued", body
        finally:
            loader.release()


@pytest.mark.parametrize("config", [{"resolution": "abc"}, {}], ids=["with-options", "without"])
async def test_with_no_queue_a_create_while_every_worker_is_loading_is_a_503_no_worker_not_no_capacity(config):
    """With ``--queue-size 0`` such a create was a 429 ``no_capacity``, "no retained slot is free and the queue is
    disabled": the server full, where it was only starting (a new-user pass)."""
    loader = GatedLoader()
    async with serve(make_settings(queue_size=0), loader=loader, ready=False) as s:
        try:
            status, body, response = await s.create("ctl", config=config)
            assert status == 503, body
            assert_error_body(status, body, "no_worker")
            assert int(response.headers["Retry-After"]) > 0
            assert not list(s.runtime.registry)
        finally:
            loader.release()


@pytest.mark.parametrize(
    ("options", "named"),
    [({"fps": 0}, "'fps'"), ({"width": 15}, "'width'"), ({"colour": "red"}, "colour"),
     ({"width": 4096, "height": 4096, "frames_per_chunk": 1024}, "'frames_per_chunk'")],
)
async def test_the_replay_check_is_the_one_its_stream_runs(options: dict[str, Any], named: str) -> None:
    service = ReplayService()
    async with service.running():
        with pytest.raises(ValueError, match=named) as checked:
            await service.check_options(options)
        with pytest.raises(ValueError) as streamed:
            service.stream(SessionConfig(options=options))
        assert str(checked.value) == str(streamed.value)
        await service.check_options({"fps": 24, "width": 64, "height": 48})


class SilentCheck(CounterService):
    """A pipeline whose option check never answers (a hung check's stand-in)."""

    async def check_options(self, options: Any) -> None:
        await trio.sleep_forever()


async def test_a_check_that_never_answers_is_a_503_at_its_deadline(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(option_check, "CHECK_OPTIONS_TIMEOUT", 0.2)  # the 10 s deadline, shortened
    async with runner_fixtures.serve(runner_fixtures.settings(), SilentCheck()) as s:
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl", "config": {"continuous": True}})
        assert status == 503 and body["error"] == "no_worker", body
        assert "could not be checked: no answer in time" in body["detail"]
        assert not list(s.runtime.registry) and s.free_slots() == 1
        assert s.runtime.option_checks.limiter.borrowed_tokens == 0


async def test_a_create_with_no_options_is_taken_unchecked_when_no_worker_answers(autojump_clock: Any) -> None:
    """When the check gets no answer, a create with options is a 503 and one without is taken, as with every worker
    loading (the README's word, and check_options' own): it was a 503 as well, so one mute worker turned away every
    create, options or not."""
    async with runner_fixtures.serve(runner_fixtures.settings(), SilentCheck()) as s:
        asked = trio.current_time()
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl"})
        assert status == 200 and body["status"] == "assigned", body
        assert trio.current_time() - asked >= option_check.WORKER_CHECK_TIMEOUT  # it did wait for the answer
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl-2", "config": {"continuous": True}})
        assert status == 503 and "could not be checked: no answer in time" in body["detail"], body
        assert s.runtime.option_checks.limiter.borrowed_tokens == 0


async def test_checks_that_get_no_answer_are_logged_at_a_pace(autojump_clock: Any, caplog: pytest.LogCaptureFixture):
    """One warning for every create that a mute worker failed to check: a flood of creates flooded the log."""
    caplog.set_level(logging.WARNING, logger="chunkline.runtime")
    creates = 3 * LOG_BURST
    async with runner_fixtures.serve(runner_fixtures.settings(), SilentCheck()) as s:
        async with trio.open_nursery() as nursery:
            for index in range(creates):
                nursery.start_soon(functools.partial(s.json, "post", SESSIONS,
                                                     json={"identity": f"c{index}", "config": {"continuous": True}}))
        await elapse(60)  # the pace allows a line again
        status, _ = await s.json("post", SESSIONS, json={"identity": "late", "config": {"continuous": True}})
        assert status == 503
    lines = [r.getMessage() for r in caplog.records if "could not check a session's options" in r.getMessage()]
    assert LOG_BURST <= len(lines) < creates, len(lines)
    left_out = re.search(r"\((\d+) more like it were not logged\)", lines[-1])
    assert left_out is not None and len(lines) + int(left_out.group(1)) == creates + 1, lines[-1]


#: a pipeline that requires an option: its check (the one its create_session runs) refuses a config without it
REQUIRES_SCENE = """
from contextlib import asynccontextmanager

from pipelines.contract import BidirectionalService


class RequiresScene(BidirectionalService):
    @asynccontextmanager
    async def running(self):
        yield self

    async def check_options(self, options):
        if "scene" not in options:
            raise ValueError("the option 'scene' is required (the name of the world to open)")

    async def create_session(self, config, *, on_event=None):
        await self.check_options(config.options)
        return "only"

    async def push_control(self, session_id, control):
        pass

    def chunks(self, session_id):
        raise NotImplementedError("no session of these tests joins")

    async def close_session(self, session_id):
        pass


def get_service(gpu_num=0, **_):
    return RequiresScene()
"""


async def creates_refuse_no_options_naming_the_required_one(post: Any, agent: str | None = None) -> None:
    """``post(config)`` -> (status, body): no config is a 400 naming the option (and the ``agent`` whose word it
    is); with it, the slot is taken."""
    status, body = await post({})
    assert status == 400 and body["error"] == "invalid_option", body
    said_by = "" if agent is None else f"worker {agent!r} refused them: "
    assert body["detail"] == f"config: {said_by}the option 'scene' is required (the name of the world to open)", body
    status, body = await post({"scene": "meadow"})
    assert status == 200 and body["status"] == "assigned", body


@pytest.mark.parametrize("loader", [load_service, start_process_service], ids=["in-process", "worker-process"])
async def test_a_required_option_missing_from_an_empty_config_is_a_400_at_create(loader: Any, tmp_path: Path) -> None:
    path = tmp_path / "requires_scene.py"
    path.write_text(REQUIRES_SCENE)
    worker_mode = "process" if loader is start_process_service else "in-process"
    settings = runner_fixtures.settings(pipeline=str(path), worker_mode=worker_mode, queue_size=0)
    async with runner_fixtures.serve(settings, loader, ready=False) as s:
        await wait_until(lambda: s.runtime.ready, "the worker", deadline=120)

        async def post(config: dict[str, Any]) -> tuple[int, Any]:
            return await s.json("post", SESSIONS, json={"identity": "ctl", "config": config})

        await creates_refuse_no_options_naming_the_required_one(post)
        assert len(s.runtime.registry) == 1  # the refused create left nothing


async def test_a_required_option_missing_from_an_empty_config_is_a_400_at_create_with_agents(tmp_path: Path) -> None:
    path = tmp_path / "requires_scene.py"
    path.write_text(REQUIRES_SCENE)
    app = AgentApp(runner_fixtures.settings(pipeline=str(path), workers="local", num_workers=1, queue_size=0,
                                            heartbeat_deadline=30.0))
    try:
        await app.wait_clean()
        async with httpx.AsyncClient(base_url=app.url or "", timeout=30) as http:
            async def post(config: dict[str, Any]) -> tuple[int, Any]:
                response = await http.post(SESSIONS, json={"identity": "ctl", "config": config})
                return response.status_code, response.json()

            (agent,) = [worker["worker_id"] for worker in (await http.get("/v1/stream/health")).json()["workers"]]
            await creates_refuse_no_options_naming_the_required_one(post, agent)
        await app.reset()
    finally:
        await trio.to_thread.run_sync(app.stop)


class SaysConfig(CounterService):
    async def check_options(self, options: Any) -> None:
        raise ValueError("config: option 'k' is not one this pipeline takes")


async def test_a_pipeline_reason_that_already_says_config_is_not_prefixed_again():
    """It read ``config: config: option 'k' ...``."""
    async with runner_fixtures.serve(runner_fixtures.settings(), SaysConfig()) as s:
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl", "config": {"k": 1}})
        assert (status, body["error"]) == (400, "invalid_option"), body
        assert body["detail"] == "config: option 'k' is not one this pipeline takes", body


class BrokenCheck(CounterService):
    async def check_options(self, options: Any) -> None:
        return options["k"] + 1  # a KeyError for options without 'k', a TypeError for a 'k' that is no number


@pytest.mark.parametrize(("options", "raised"), [({"k": "x"}, "TypeError"), ({"j": 1}, "KeyError: 'k'")])
async def test_a_check_that_raises_other_than_value_error_is_told_as_the_pipeline_s_bug(options, raised):
    """It was a 503 that gave the check's bare words (``could not be checked: 'k'``) and let the client retry for
    ever: nothing said the pipeline was at fault, nor what the contract asks of its check."""
    async with runner_fixtures.serve(runner_fixtures.settings(), BrokenCheck()) as s:
        status, body = await s.json("post", SESSIONS, json={"identity": "ctl", "config": options})
        assert (status, body["error"]) == (503, "no_worker"), body
        assert body["detail"].startswith(
            f"the session's options could not be checked: pipeline bug: check_options raised {raised}"), body
        assert "it must raise ValueError naming an option it refuses" in body["detail"]
        assert not list(s.runtime.registry) and s.free_slots() == 1

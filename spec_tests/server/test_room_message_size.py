"""A room message's size limit counts what the client sent, not what the room made of it.

The local room handed the worker each envelope's payload written again by Python's ``json.dumps`` (a space after each
separator, ``\\uXXXX`` for every character past ASCII), and the control's size was checked there: a compact control
of 10 KB was refused ``too_large`` as 15 KB, and a prompt of 1,500 emoji, 6 KB as a client sends it in UTF-8, as
18 KB, though a prompt may have 2,000 characters. Through the local room protocol, in-process on trio's autojump
clock, with a controller that sends compact UTF-8 JSON as browsers and most clients do.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipelines.contract import ControlType

from .runner_fixtures import CounterService, join, no_threads, serve, settings  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("no_threads")


def compact(message: Any) -> str:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False)


def escaped(message: Any) -> str:
    """As Python's ``json.dumps`` writes it by default: ``\\uXXXX`` for every character past ASCII, spaces after
    separators."""
    return json.dumps(message)


@pytest.mark.parametrize("written", [compact, escaped], ids=["compact", "escaped"])
async def test_a_prompt_within_the_limit_as_compact_utf8_is_taken_however_it_is_sent(
        written: Any, autojump_clock: Any) -> None:
    """1,500 emoji: 6 KB as compact UTF-8, so within the limit, and 18 KB as Python writes JSON by default (it was
    refused ``too_large`` either way). One past the limit as compact UTF-8 still is, however sent."""
    service = CounterService()
    async with serve(settings(), service) as s:
        limit = s.runtime.settings.max_data_message_bytes
        prompt = "\U0001f600" * 1500  # 4 bytes each in UTF-8, 12 as JSON's ASCII escapes
        sent = written({"topic": "tf.control", "payload": {"type": "prompt", "prompt": prompt}})
        assert len(compact({"type": "prompt", "prompt": prompt}).encode()) < limit < len(escaped(prompt).encode())
        over = {"type": "control_state", "controls": ["w"] * (limit // 4 + 1)}  # past the limit as compact UTF-8
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            await ctl.ws.send(sent)
            (session,) = service.sessions.values()
            await ctl.wait_for(lambda p: [c for c in session.controls if c.type is ControlType.PROMPT], "the prompt")
            assert [c.prompt for c in session.controls if c.type is ControlType.PROMPT] == [prompt]
            assert not ctl.status("control_rejected")
            await ctl.ws.send(written({"topic": "tf.control", "payload": over}))
            (rejected,) = await ctl.wait_for(lambda p: p.status("control_rejected"), "its answer")
            assert rejected["reason"] == "too_large", rejected


async def test_a_compact_control_within_the_limit_is_taken(autojump_clock: Any) -> None:
    service = CounterService()
    async with serve(settings(), service) as s:
        limit = s.runtime.settings.max_data_message_bytes
        # a control_state with a long list of keys, compact: within the limit as sent, past it with Python's spaces
        payload = {"type": "control_state", "controls": ["w"] * ((limit - 100) // 4)}
        sent = compact({"topic": "tf.control", "payload": payload})
        assert len(sent.encode()) < limit < len(json.dumps(payload).encode())
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: "running" in p.stages(), "running")
            await ctl.ws.send(sent)
            (rejected,) = await ctl.wait_for(lambda p: p.status("control_rejected"), "its answer")
            # a key named twice: refused for what it says, not for its size
            assert rejected["reason"] == "duplicate_control", rejected


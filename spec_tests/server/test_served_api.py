"""The REST API as a new user meets it: a real ``chunkline stream-serve`` process, real HTTP on loopback.

Each refusal is a 4xx naming what was wrong and changes nothing; nothing a client sends is taken and ignored.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from .served_process import stream_serve

SESSIONS = "/v1/stream/sessions"


@pytest.fixture
async def client(short_tmp: Path) -> AsyncIterator[httpx.AsyncClient]:
    """``chunkline stream-serve pipelines/replay`` on a free loopback port, ready; stopped with SIGTERM."""
    async with stream_serve(short_tmp, "--queue-size", "2") as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            await served.wait_ready(http)
            yield http
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()


async def test_the_session_list_refuses_a_query_it_would_ignore(client: httpx.AsyncClient) -> None:
    """``?stauts=running`` listed every session and ``?status=running&status=closed`` the running ones only,
    both with a 200: a misspelt or repeated filter was taken and ignored."""
    created = await client.post(SESSIONS, json={"identity": "ctl"})
    assert created.status_code == 200, created.text
    everything = (await client.get(SESSIONS)).json()["sessions"]
    assert [s["session_id"] for s in everything] == [created.json()["session_id"]]
    for query, words in [("stauts=running", ("unknown query parameter", "'stauts'", "'status'")),
                         ("status=running&status=closed", ("status is given 2 times",)),
                         ("status=bogus", ("unknown status", "'bogus'")),
                         ("status=closed&offset=5", ("'offset'",))]:
        response = await client.get(f"{SESSIONS}?{query}")
        assert response.status_code == 400, (query, response.text)
        body = response.json()
        assert body["error"] == "invalid_query" and all(word in body["detail"] for word in words), (query, body)
    assert (await client.get(SESSIONS)).json()["sessions"] == everything  # nothing changed
    running = await client.get(f"{SESSIONS}?status={everything[0]['status']}")
    assert [s["session_id"] for s in running.json()["sessions"]] == [created.json()["session_id"]]


async def test_a_query_parameter_or_a_body_a_route_does_not_read_is_refused_and_changes_nothing(
    client: httpx.AsyncClient,
) -> None:
    """Only the session list read its query: ``POST /v1/stream/sessions?foo=1`` created a session, ``POST
    .../drain?x=1`` drained the worker for good, and a ``DELETE`` with a body closed the session, each ignoring
    what it was given."""
    created = await client.post(SESSIONS, json={"identity": "ctl"})
    assert created.status_code == 200, created.text
    session = f"{SESSIONS}/{created.json()['session_id']}"
    refused = [
        await client.post(f"{SESSIONS}?foo=1", json={"identity": "other"}),
        await client.post("/v1/service/workers/worker-0/drain?x=1", json={"deadline_seconds": 1}),
        await client.get("/v1/stream/health?verbose=1"),
        await client.get(f"{session}?fields=status"),
    ]
    for response in refused:
        body = response.json()
        assert (response.status_code, body["error"]) == (400, "invalid_query"), response.text
        assert "takes no query parameters" in body["detail"], body
    with_body = await client.request("DELETE", session, json={"reason": "done"})
    assert (with_body.status_code, with_body.json()["error"]) == (400, "invalid_body"), with_body.text
    # nothing changed: one session, still live; the worker still takes sessions
    listed = (await client.get(SESSIONS)).json()["sessions"]
    assert [s["session_id"] for s in listed] == [created.json()["session_id"]] and listed[0]["status"] != "closed"
    health = (await client.get("/v1/stream/health")).json()
    assert health["worker_slots"]["worker-0"]["state"] == "running", health
    assert (await client.delete(session)).json()["status"] == "closed"


async def test_the_log_says_once_where_clients_connect_and_nothing_of_the_socket_behind_the_front(
    short_tmp: Path,
) -> None:
    """hypercorn's "Running on http://unix:..." came twice (its handler, then the server's), naming a socket no
    client may use, beside the server's own "serving ... on http://127.0.0.1:PORT"."""
    async with stream_serve(short_tmp) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            await served.wait_ready(http)
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
    assert "Running on" not in served.text() and "unix:" not in served.text(), served.text()
    assert served.text().count(served.url) == 1, served.text()


REFUSED_SETTINGS = [
    (("--max-sessions-per-worker", "2", "--worker-mode", "in-process"), "max_sessions_per_worker=2 is refused"),
    (("--max-sessions-per-worker", "2", "--worker-mode", "process"), "max_sessions_per_worker=2 is refused"),
    (("--placement", "{}"), "does not accept ['placement']"),  # a pipeline with no stages to place
    (("--placement", "{}", "--worker-mode", "process"), "does not accept ['placement']"),  # said in its child
    # the toy world takes a placement and refuses one it cannot run (get_service raises ValueError): each was a
    # worker restarted six times, a traceback each, although every replacement refused the same value
    # (one that is not JSON is refused at start now, exit 2: test_serve_startup.py)
    (("pipelines/toy_world", "--placement", '{"mode": "bogus"}'), "placement mode must be one of"),
    # a placement file nested too deep was a RecursionError, the worker restarted with a traceback each time
    (("pipelines/toy_world", "--placement", "deep.json"), "is nested too deep to be a placement"),
]


@pytest.mark.parametrize(("options", "named"), REFUSED_SETTINGS,
                         ids=["sessions", "sessions-process", "placement", "placement-process", "toy-mode", "toy-deep"])
async def test_settings_the_pipeline_refuses_fail_the_worker_once_not_in_a_crash_loop(
    short_tmp: Path, options: tuple[str, ...], named: str
) -> None:
    """The replay pipeline pushes one session per worker and has no stages: ``--max-sessions-per-worker 2`` and a
    placement are refused as it loads. The slot restarted the worker five times over about half a minute, a
    traceback each, although every replacement refused the same settings; it gives up at once now, and health
    and a create say why."""
    pipeline, options = (options[0], options[1:]) if options[0].startswith("pipelines/") else ("pipelines/replay", options)
    if "deep.json" in options:
        (short_tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
        options = tuple(str(short_tmp / "deep.json") if option == "deep.json" else option for option in options)
    async with stream_serve(short_tmp, *options, pipeline=pipeline) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            await served.read_until(b"refused its configuration")
            health = (await http.get("/v1/stream/health")).json()
            slot = health["worker_slots"]["worker-0"]
            assert (slot["state"], health["status"], health["worker_restarts"]) == ("gave_up", "unhealthy", 0), health
            assert named in slot["reason"], slot
            created = await http.post(SESSIONS, json={"identity": "ctl"})
            assert created.status_code == 503 and created.json()["error"] == "no_worker", created.text
            assert "refused its configuration" in created.json()["detail"], created.text
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
    assert "started worker-0.1" not in served.text() and "restart 1 of" not in served.text(), served.text()
    assert "Traceback" not in served.text(), served.text()  # a refused setting is one line, not a traceback


async def test_a_pipeline_file_python_cannot_read_is_one_line_naming_its_line_not_a_traceback(short_tmp: Path) -> None:
    """A syntax error in the pipeline file: the worker's line names the file and the line; the traceback after it
    (about 40 lines of the loader's and trio's thread's, logged again at the one restart) said nothing more."""
    pipeline = short_tmp / "broken.py"
    pipeline.write_text("def get_service(gpu_num=0:\n    pass\n")
    async with stream_serve(short_tmp, pipeline=str(pipeline)) as served:
        await served.read_until(b"the pipeline never loaded")
        served.process.send_signal(signal.SIGTERM)
        assert await served.exit_code() == 0, served.text()
    assert "SyntaxError: invalid syntax (broken.py, line 1)" in served.text(), served.text()
    assert "Traceback" not in served.text(), served.text()

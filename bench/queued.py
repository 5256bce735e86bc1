"""Queued sessions at scale: what a create, a look, a delete and the shutdown cost with N sessions queued.

``python -m bench.queued [--sizes 100,1000,10000] [--samples 20]``

One in-process app per size (``create_app`` with ``pipelines/replay``: no model, one retained session per
worker, one worker), driven through its ASGI test client, so that the figures are the server's and not a
network's. One session takes the worker's slot; then ``N`` creates queue behind it (``--queue-size N``). One
JSON line per size (``"figure": "queued"``):

- ``create_first_ms`` / ``create_last_ms``: the mean wall time of the first and of the last ``--samples``
  queued creates (``POST /v1/stream/sessions``, HTTP 202); with a create that does not depend on the queue's
  length the two are alike;
- ``get_last_ms``: ``GET`` of the last queued session (its place is N); ``delete_middle_ms``: ``DELETE`` of the
  session queued in the middle; ``list_ms``: ``GET /v1/stream/sessions`` (its first page: 100 sessions);
- ``shutdown_queued_s``: from the start of the runtime's shutdown until every queued session has failed with
  the shutdown's reason; ``longest_hold_ms``: the longest the event loop went without running a task that asks
  to run every millisecond, over the shutdown (how long health checks and live sessions would wait);
- ``failed``: the queued sessions that ended failed with the shutdown's reason (N - 1: one was deleted).

The last line (``"figure": "summary"``) gives, for the largest size over the smallest, ``create_last_ratio``
(goal: about 1) and ``shutdown_per_session_ratio`` (the shutdown's time per queued session; goal: about 1).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import trio

from server.app import create_app
from server.runtime import SHUTDOWN_REASON, StreamRuntime
from server.settings import ServerSettings
from states.stream_session import State

SESSIONS = "/v1/stream/sessions"
TICK = 0.001  # seconds between the watcher's ticks
READY_DEADLINE = 60.0


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


async def timed(call: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await call
    return time.perf_counter() - started, result


async def create(client: Any) -> tuple[float, int, dict[str, Any]]:
    seconds, response = await timed(client.post(SESSIONS, json={"identity": "bench"}))
    return seconds, response.status_code, json.loads(await response.get_data())


async def watch_holds(holds: list[float], stop: trio.Event) -> None:
    """Record how late each millisecond tick came: the event loop was held that long by something else."""
    while not stop.is_set():
        before = time.perf_counter()
        await trio.sleep(TICK)
        holds.append(time.perf_counter() - before - TICK)


async def one_size(size: int, samples: int) -> dict[str, Any]:
    settings = ServerSettings(pipeline="pipelines/replay", max_sessions_per_worker=1, queue_size=size,
                              controller_timeout=3600, room_empty_timeout=3600, session_timeout=3600,
                              skip_validation=True)
    app = create_app(settings)
    runtime: StreamRuntime = app.extensions["chunkline"]
    async with app.test_app() as test_app:
        client = test_app.test_client()
        with trio.fail_after(READY_DEADLINE):
            while not runtime.ready:
                await trio.sleep(0.01)
        _, status, _ = await create(client)
        assert status == 200, status
        times: list[float] = []
        last: dict[str, Any] = {}
        for _ in range(size):
            seconds, status, last = await create(client)
            assert status == 202, (status, last)
            times.append(seconds)
        assert last["queue_position"] == size, last
        get_seconds, response = await timed(client.get(f"{SESSIONS}/{last['session_id']}"))
        assert json.loads(await response.get_data())["queue_position"] == size
        list_seconds, response = await timed(client.get(SESSIONS))
        assert len(json.loads(await response.get_data())["sessions"]) == size + 1
        middle = runtime.book.queued_ids()[size // 2]
        delete_seconds, response = await timed(client.delete(f"{SESSIONS}/{middle}"))
        assert response.status_code == 200
        queued = [runtime.registry.get(session_id) for session_id in runtime.book.queued_ids()]
        holds: list[float] = []
        stop = trio.Event()
        ended_at: list[float] = []

        async def shut_down() -> None:
            await runtime.shutdown(1.0)

        async def wait_queued_ended() -> None:
            ended = 0  # the records before this one have ended (each looked at once: the watch costs O(N) in all)
            while ended < len(queued):
                if queued[ended].status is State.QUEUED:
                    await trio.sleep(TICK)
                else:
                    ended += 1
            ended_at.append(time.perf_counter())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_holds, holds, stop)
            await trio.sleep(TICK)
            started = time.perf_counter()
            nursery.start_soon(wait_queued_ended)
            await shut_down()
            stop.set()
    failed = sum(1 for r in queued if r.status is State.FAILED and r.error == SHUTDOWN_REASON)
    return {
        "figure": "queued",
        "queued": size,
        "create_first_ms": ms(sum(times[:samples]) / samples),
        "create_last_ms": ms(sum(times[-samples:]) / samples),
        "get_last_ms": ms(get_seconds),
        "list_ms": ms(list_seconds),
        "delete_middle_ms": ms(delete_seconds),
        "shutdown_queued_s": round(ended_at[0] - started, 4) if ended_at else None,
        "longest_hold_ms": ms(max(holds, default=0.0)),
        "failed": failed,
    }


async def main(sizes: list[int], samples: int) -> None:
    rows = []
    for size in sizes:
        row = await one_size(size, min(samples, size))
        emit(row)
        rows.append(row)
    small, large = rows[0], rows[-1]
    emit({
        "figure": "summary",
        "sizes": sizes,
        "create_last_ratio": round(large["create_last_ms"] / small["create_last_ms"], 2),
        "shutdown_per_session_ratio": round(
            (large["shutdown_queued_s"] / large["queued"]) / (small["shutdown_queued_s"] / small["queued"]), 2
        ),
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    trio.run(main, [int(s) for s in args.sizes.split(",")], args.samples)

"""The authority holds an agent-hosted session's viewer seats from the agent's reports of its LiveKit room
(``server/cluster/seat_reports.py``): each joiner a report names is taken in turn with the seat rule the server's
own workers use, so that of a crowd that came within one report only those past the seats are sent away, a viewer
already sent away is not sent away again while later reports still name it, and the agent's first word on a room
the authority only looked into (a queued session's, over its seats) brings it back to them. The real agent, LiveKit
and clients play the whole path in ``spec_tests/livekit/test_agent_viewer_seats.py``; this pins the counting.
"""

from __future__ import annotations

from server.cluster.seat_reports import seat_joiners
from server.registry import SessionRecord
from server.viewer_seats import MAX_VIEWERS_PER_SESSION

WORKER = "chunkline-worker-a"


def record_with(*present: str) -> SessionRecord:
    record = SessionRecord("s1", "room-1", "ctl", {}, None, None, 0.0, None, None)
    record.participants = set(present)
    return record


def viewers(count: int, start: int = 0) -> tuple[str, ...]:
    return tuple(f"v{index:02d}" for index in range(start, start + count))


async def test_of_two_joiners_in_one_report_for_the_last_seat_the_one_named_later_is_over() -> None:
    seated = viewers(MAX_VIEWERS_PER_SESSION - 1)
    record = record_with("ctl", WORKER, *seated)
    report = ("ctl", WORKER, *seated, "x-first", "x-second", "x-second")  # a name twice is one participant
    over = seat_joiners(record, report, first=False)
    assert [identity for identity, _ in over] == ["x-second"]
    assert record.participants == set(report)  # counted until a report says it left
    assert seat_joiners(record, report, first=False) == []  # the same room again: nobody is sent away twice
    left = tuple(identity for identity in report if identity != "x-second")
    assert seat_joiners(record, left, first=False) == [] and "x-second" not in record.participants


async def test_the_agents_first_report_brings_a_queued_room_over_its_seats_back_to_them() -> None:
    crowd = viewers(MAX_VIEWERS_PER_SESSION + 2)
    record = record_with("ctl", *crowd)  # as the authority's looks saw the queued room
    over = seat_joiners(record, ("ctl", WORKER, *crowd), first=True)
    assert [identity for identity, _ in over] == list(crowd[-2:])  # never the controller or the worker
    assert all(f"all {MAX_VIEWERS_PER_SESSION} viewer seats are taken" in why for _, why in over)

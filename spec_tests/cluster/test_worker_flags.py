"""``chunkline worker`` refuses, before it loads anything, flags that could only fail later: a ``--node`` that cannot
name the agent in its rooms was refused by the authority for good (exit 3) once the pipeline had loaded and its
startup check had run, a ``--authority`` on port 0 was dialed for five minutes, a ``--drain-deadline`` of 1e300
made a SIGTERM's drain last for ever (a drain through the API takes at most an hour), and a ``--launcher-pid`` of a
running process other than its parent read as that process gone (exit 70), and a ``--placement`` that is no JSON object
was told once the pipeline had loaded (exit 3)."""

from __future__ import annotations

import subprocess

import pytest

from server.app import MAX_DRAIN_DEADLINE
from server.cluster.identity import WORKER_ID_DIGITS, worker_participant
from server.tokens import MAX_IDENTITY_LENGTH

from .conftest import ROOT, TINY, TOKEN, Process, chunkline, clean_env, start_authority, until

#: the longest node whose worker id names a room participant (``chunkline-<node>-<8 hex digits>``)
LONGEST_NODE = MAX_IDENTITY_LENGTH - len(worker_participant("-" + "0" * WORKER_ID_DIGITS))


@pytest.mark.parametrize(("flags", "named"), [
    (["--node", "my node"], "--node: 'my node' cannot name this agent in its rooms: at most 109 characters"),
    (["--node", "n" * (LONGEST_NODE + 1)], "(110 characters in all) cannot name this agent in its rooms"),
    (["--node", "bad/name"], "--node: 'bad/name' cannot name"),
    (["--authority", "tcp://127.0.0.1:0"], "--authority 'tcp://127.0.0.1:0' needs a port 1-65535"),
    # taken, the user and password, path, query and fragment were dropped, and the password written to every log line
    (["--authority", "tcp://nobody:secret@127.0.0.1:1/some/path?tls=1#x"],
     "--authority 'tcp://nobody:***@127.0.0.1:1/some/path?tls=1#x' has a user or password and a path and a query and "
     "a fragment, which the agent cannot use"),
    (["--authority", "tls://127.0.0.1:1?ca=x"], "has a query, which the agent cannot use"),
    (["--drain-deadline", "1e300"], f"--drain-deadline must be a number of seconds > 0, at most {MAX_DRAIN_DEADLINE:g}"),
    # pid 1 runs and did not start the agent: it loaded its pipeline, then exited 70 saying pid 1 was gone
    (["--launcher-pid", "1"], "--launcher-pid 1 is not the process that started this agent (its parent is pid "),
    # a placement that is no JSON object: it loaded the pipeline, then said "placement file '[]' does not exist", exit 3
    (["--placement", "[]"], "--placement: inline placement JSON must be an object, got list"),
    (["--placement", "{bad"], "--placement: inline placement JSON is not valid JSON (Expecting property name"),
], ids=["space", "too-long", "slash", "port-0", "url-parts", "url-query", "endless-drain", "not-the-parent",
        "placement-list", "placement-syntax"])
def test_the_worker_command_refuses_a_flag_that_could_only_fail_later(flags: list[str], named: str) -> None:
    run = subprocess.run(chunkline("worker", TINY, "--authority", "tcp://127.0.0.1:1", *flags), cwd=str(ROOT),
                         env=clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("chunkline worker: error: ") and named in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.splitlines()) == 1, run.stderr[-2000:]
    assert "secret" not in run.stderr


async def test_the_longest_node_the_worker_command_takes_is_one_the_authority_registers() -> None:
    """The bound the command checks is the authority's own: an agent with a node of the longest length it takes, and
    every character it allows, registers and becomes ready."""
    node = ("n_.:@-" * LONGEST_NODE)[:LONGEST_NODE]
    authority = start_authority(launcher="external", workers=1)
    agent = Process(chunkline("worker", TINY, "--authority", f"tcp://127.0.0.1:{authority.cluster_port}",
                              "--node", node, "--drain-deadline", str(MAX_DRAIN_DEADLINE)),
                    clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
    try:
        [worker] = await until(authority.eligible, "the agent to be ready", authority)
        assert worker["node"] == node and worker["worker_id"].startswith(f"{node}-"), worker
    finally:
        assert agent.stop() == 0, agent.text()
        authority.stop()

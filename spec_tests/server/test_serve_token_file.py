"""``chunkline stream-serve --cluster-token-file FILE`` (or ``CHUNKLINE_CLUSTER_TOKEN_FILE``) as a user meets it: the
authority's cluster token read from a file, as ``chunkline worker --cluster-token-file`` reads it (a regular file of
UTF-8 text, at most 4 KiB; the same errors), so that it need not be on a command line other users can read in
``ps``. A flag wins over the other source's variable; both flags, or both variables, are one line naming both; a token
file with no agents to prove it is refused before it is read. Every refusal is one line, exit code 2."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trio

from server.cluster import proofs, wire
from server.cluster.identity import chunkline_version, pipeline_digest, pipeline_name

from ..cluster.conftest import AGENTS_DIAL, ROOT, SERVING, TINY, Process, chunkline, clean_env
from ..cluster.token_files import token_file

OPTION = "--cluster-token-file"
VARIABLE = "CHUNKLINE_CLUSTER_TOKEN_FILE"
FILE_TOKEN = "the-token-in-its-file-0123456789"
EXPORTED_TOKEN = "an-exported-token-0123456789"  # for the worker command, say: the file's flag wins over it
EXIT_DEADLINE = 120.0  # seconds for the command to import what it checks with (a loaded 2-core host)
START_DEADLINE = 120.0  # seconds for the authority to serve (--workers external: it loads no pipeline itself)
PREFIX = "chunkline stream-serve: error: "
PLAN = {"computed_capacity": None, "effective_capacity": 1, "configured_limit": 1, "limiting_device": None}


def _serve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = chunkline("stream-serve", TINY, "--port", "0", *args)
    return subprocess.run(command, cwd=str(ROOT), env=clean_env(**env), capture_output=True, text=True,
                          timeout=EXIT_DEADLINE, stdin=subprocess.DEVNULL)


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), result.stderr[-2000:]
    return lines[0][len(PREFIX):]


@pytest.mark.parametrize(("kind", "words"), [
    ("pipe", "is not a regular file"),  # it would wait for a writer for ever
    ("/dev/null", "is not a regular file"),  # a device: /dev/zero would read without end
    ("large", "holds more than 4096 bytes"),
    ("latin-1", "is not UTF-8 text"),
    ("missing", "no such file"),
    ("directory", "is a directory, not a file"),
    ("blank", "is empty"),
    ("short", "holds 15 bytes; a cluster token is at least 16"),
])
@pytest.mark.parametrize("source", ["flag", "variable"])
def test_a_token_file_that_cannot_hold_a_token_is_one_line_naming_the_option_and_the_file(
    tmp_path: Path, kind: str, words: str, source: str
) -> None:
    path = token_file(tmp_path, kind)
    given = ((OPTION, str(path)), {}) if source == "flag" else ((), {VARIABLE: str(path)})
    line = _one_line(_serve("--workers", "external", *given[0], **given[1]))
    assert line.startswith(f"{OPTION}: ") and repr(str(path)) in line and words in line, line
    assert line.endswith(f"(from environment variable {VARIABLE})") == (source == "variable"), line


def test_a_long_token_file_name_is_shown_cut(tmp_path: Path) -> None:
    line = _one_line(_serve("--workers", "external", OPTION, str(tmp_path / ("n" * 200) / "token")))
    assert "no such file" in line and "n" * 200 not in line and "characters in all" in line, line


@pytest.mark.parametrize("where", ["flags", "variables"])
def test_a_token_and_a_token_file_together_are_one_line_naming_both(tmp_path: Path, where: str) -> None:
    (tmp_path / "token").write_text(FILE_TOKEN)
    if where == "flags":
        result = _serve("--workers", "external", "--cluster-token", EXPORTED_TOKEN, OPTION, str(tmp_path / "token"))
    else:
        result = _serve("--workers", "external", CHUNKLINE_CLUSTER_TOKEN=EXPORTED_TOKEN, **{VARIABLE: str(tmp_path / "token")})
    line = _one_line(result)
    assert line.startswith(f"--cluster-token and {OPTION} both give the cluster token"), line
    assert ("CHUNKLINE_CLUSTER_TOKEN and CHUNKLINE_CLUSTER_TOKEN_FILE" in line) == (where == "variables"), line
    assert EXPORTED_TOKEN not in line and FILE_TOKEN not in line  # a secret is never echoed


@pytest.mark.parametrize("source", ["flag", "variable"])
def test_a_token_file_without_worker_agents_is_refused_before_it_is_read(source: str) -> None:
    """With in-process workers no agent proves a token: the file would be ignored (it is not even opened: a missing
    one is refused for what it is given with, not for being missing)."""
    missing = "/run/secrets/no-such-token"
    result = _serve(OPTION, missing) if source == "flag" else _serve(**{VARIABLE: missing})
    line = _one_line(result)
    assert line.startswith(f"{OPTION} ({missing}) applies to worker agents (--workers local, ray or external); with "
                           f"--workers in-process it would be ignored"), line


async def _register(cluster_port: int, token: str, worker_id: str) -> tuple[wire.Channel, wire.Message, str]:
    """A registration proving ``token``, as an agent sends it; the authority's answer and its nonce."""
    stream = await trio.open_tcp_stream("127.0.0.1", cluster_port)
    channel = wire.Channel(stream)
    with trio.fail_after(30):
        hello = await channel.receive()
        assert isinstance(hello, wire.Hello), hello
        await channel.send(wire.Register(
            worker_id=worker_id, agent_nonce="agent-nonce", proof=proofs.proof_for(token, hello.nonce, worker_id),
            version=chunkline_version(), pipeline=pipeline_name(TINY), pipeline_digest=pipeline_digest(TINY),
            node="token-file", devices=(), launcher="external", pid=1))
        return channel, await channel.receive(), hello.nonce


@pytest.mark.parametrize("source", ["flag", "variable", "flag-over-exported-token"])
async def test_the_authority_proves_and_takes_the_token_of_its_file(tmp_path: Path, source: str) -> None:
    """A real authority whose token is only in a file: an agent proving that token is welcomed (and the welcome
    proves it back), one proving another is refused; with ``--cluster-token-file`` given, an exported
    ``CHUNKLINE_CLUSTER_TOKEN`` is not the token (the flag wins, as for ``chunkline worker``)."""
    (tmp_path / "token").write_text(f"{FILE_TOKEN}\n")  # white space around it is not part of it
    args = ["--workers", "external", "--num-workers", "1", "--cluster-port", "0"]
    env: dict[str, str] = {}  # (not TMPDIR=tmp_path: under xdist its path is too long for the front's Unix socket)
    if source == "variable":
        env[VARIABLE] = str(tmp_path / "token")
    else:
        args += [OPTION, str(tmp_path / "token")]
    if source == "flag-over-exported-token":
        env["CHUNKLINE_CLUSTER_TOKEN"] = EXPORTED_TOKEN
    authority = Process(chunkline("stream-serve", TINY, "--port", "0", *args), clean_env(**env))
    try:
        give_up = time.monotonic() + START_DEADLINE
        while not ((serving := SERVING.search(authority.raw)) and (dial := AGENTS_DIAL.search(authority.raw))):
            assert authority.popen.poll() is None and time.monotonic() < give_up, authority.text()
            await trio.sleep(0.05)  # bench-cost: real-time poll of another process, bounded by a deadline
        channel, reply, nonce = await _register(int(dial.group(1)), FILE_TOKEN, "file-agent")
        assert isinstance(reply, wire.Welcome), (reply, authority.text())
        assert proofs.authority_proof_matches(FILE_TOKEN, nonce, "agent-nonce", "file-agent", reply.proof), reply
        channel.authenticate(proofs.frame_key(FILE_TOKEN, nonce, "agent-nonce", "file-agent"), authority=False)
        await channel.send(wire.Ready(1, "bidirectional", PLAN))
        async with httpx.AsyncClient(base_url=serving.group(1).decode(), timeout=10) as client:
            with trio.fail_after(30):
                while not any(w["worker_id"] == "file-agent" for w in (await client.get("/v1/stream/health")).json()["workers"]):
                    await trio.sleep(0.05)  # bench-cost: the authority takes the Ready on its own loop
        await channel.aclose()
        other, refused, _ = await _register(int(dial.group(1)), EXPORTED_TOKEN, "other-agent")
        await other.aclose()
        assert isinstance(refused, wire.Refused) and refused.reason == "the cluster token does not match", refused
    finally:
        rc = authority.stop()
    assert rc == 0, authority.text()
    assert FILE_TOKEN.encode() not in authority.raw and EXPORTED_TOKEN.encode() not in authority.raw


def test_plain_hypercorn_reads_the_token_file_variable_and_names_it_when_it_cannot(tmp_path: Path) -> None:
    """``hypercorn server:app`` takes its settings from the environment only: the variable is read there too, and a
    file that cannot hold a token is one line naming the variable, as a bad setting is."""
    command = [*chunkline()[:1], "-m", "hypercorn", "--workers", "0", "--bind", "127.0.0.1:0", "server:app"]
    env = clean_env(CHUNKLINE_PIPELINE=TINY, CHUNKLINE_WORKERS="external", **{VARIABLE: str(tmp_path / "missing")})
    result = subprocess.run(command, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=EXIT_DEADLINE,
                            stdin=subprocess.DEVNULL)
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        f"chunkline: {OPTION}: no such file {str(tmp_path / 'missing')!r} (from environment variable {VARIABLE})"
    ], result.stderr[-2000:]
    assert result.returncode == 2, result.stderr[-2000:]

"""The cluster port over TLS (``--cluster-tls-cert``/``--cluster-tls-key``; agents dial ``tls://`` with
``--tls-ca``), through real processes: the authority, its local agent, and agents and peers the test starts.

Before: local agents never registered with a certificate of a private CA (they were not told to trust it);
an agent that did not trust the certificate logged "authority unreachable: ConnectionClosed: connection broke: "
(the ssl error was lost) and gave up after a crash loop; a CA file it could not read was a failed dial every few
seconds for five minutes; a certificate and a key that are not a pair ended stream-serve with a traceback;
each failed handshake of anyone at all was a warning line (3,000 a second from one peer); and an authority
started with a certificate its agents would refuse (expired, or not naming the address its launcher's agents
dial) said nothing."""

from __future__ import annotations

import datetime
import subprocess
import time
from pathlib import Path

import trio
import trustme

from server.log_pace import LOG_BURST, LOG_LINES_PER_SECOND

from .conftest import TINY, TOKEN, Process, chunkline, clean_env, start_cluster, until

PATIENCE = 120.0  # wall seconds for an agent process to import torch, build its model and dial


def write_pair(ca: trustme.CA, folder: Path, name: str = "127.0.0.1", **valid: datetime.datetime) -> tuple[Path, Path]:
    """A certificate for ``name`` issued by ``ca`` (``valid``: its not_before and not_after), and its key, as PEM files."""
    issued = ca.issue_cert(name, **valid)
    cert, key = folder / "cluster.pem", folder / "cluster.key"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return cert, key


async def test_agents_dial_over_tls_and_what_fails_there_is_named(tmp_path: Path) -> None:
    ca, stranger = trustme.CA(), trustme.CA()
    cert, key = write_pair(ca, tmp_path)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    stranger.cert_pem.write_to_path(str(tmp_path / "stranger.pem"))
    # the local launcher's agent trusts the authority's own certificate (a private CA's: in no system store)
    cluster = start_cluster("--cluster-tls-cert", str(cert), "--cluster-tls-key", str(key), workers=1)
    untrusting = None
    try:
        assert cluster.get("/v1/service/metadata")["cluster"]["authority_url"].startswith("tls://")
        authority = f"tls://127.0.0.1:{cluster.cluster_port}"

        # an agent whose --tls-ca does not vouch for the certificate: named, dialed again uncounted
        untrusting = Process(chunkline("worker", TINY, "--authority", authority, "--tls-ca",
                                       str(tmp_path / "stranger.pem")), clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN))
        await until(lambda: "certificate verify failed" in untrusting.text(200_000)
                    and cluster.process.text(1_000_000).count("failed its handshake") >= 2,
                    "the untrusting agent's second dial", deadline=PATIENCE)
        log = untrusting.text(200_000)
        assert "not one --tls-ca trusts" in log and "not counted as a crash" in log, log
        # and the authority's side says what it most likely met (it gave the ssl reason alone)
        assert "an agent whose --tls-ca does not trust this certificate?" in cluster.process.text(1_000_000)
        assert "crash loop" not in log and "Traceback" not in log, log
        assert len(cluster.eligible()) == 1  # the agent that trusts it is served all along

        # anyone can fail a handshake, as often as it can connect: the authority's log takes a burst, then one a second
        def handshake_lines() -> list[str]:
            return [line for line in cluster.process.text(1_000_000).splitlines() if "failed its handshake" in line]

        async def fail_a_handshake() -> None:
            with trio.move_on_after(5):
                stream = await trio.open_tcp_stream("127.0.0.1", cluster.cluster_port)
                try:
                    await stream.send_all(b"GET / HTTP/1.1\r\n\r\n")  # not TLS
                    await stream.receive_some(100)  # until the authority drops it
                except (trio.BrokenResourceError, OSError):
                    pass
                await stream.aclose()

        started = time.monotonic()
        before = len(handshake_lines())
        for _ in range(60):
            await fail_a_handshake()
        # the lines left out are counted on the next one logged: on a fast host the whole churn can fit before the pace
        # lets another line through, so one more failure comes once it does
        await trio.sleep(1.2 / LOG_LINES_PER_SECOND)  # bench-cost: real time for the pace to let one more line through
        await fail_a_handshake()
        await until(lambda: any("more like it were not logged" in line for line in handshake_lines()[before:]) or None,
                    "a line counting the handshake failures left out", cluster, deadline=30)
        took = time.monotonic() - started
        logged = len(handshake_lines()) - before  # the untrusting agent's dials share the pace, and are counted too
        assert 1 <= logged <= LOG_BURST + LOG_LINES_PER_SECOND * took + 2, (logged, took, cluster.process.text())
        assert "TLS failed: " in cluster.process.text(1_000_000)
    finally:
        if untrusting is not None:
            untrusting.stop()
        cluster.stop()


def test_tls_files_that_cannot_work_are_refused_as_the_processes_start(tmp_path: Path) -> None:
    cert, _key = write_pair(trustme.CA(), tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _other_cert, other_key = write_pair(trustme.CA(), other)
    serve = subprocess.run(
        chunkline("stream-serve", TINY, "--port", "0", "--workers", "external", "--cluster-port", "0",
                  "--cluster-tls-cert", str(cert), "--cluster-tls-key", str(other_key)),
        env=clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN), capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2, serve.stderr
    assert "are not a certificate and its private key" in serve.stderr and "Traceback" not in serve.stderr, serve.stderr

    # a certificate the agents would refuse: the local launcher's dial 127.0.0.1; any agent refuses an expired one
    named = tmp_path / "named"
    named.mkdir()
    elsewhere, elsewhere_key = write_pair(trustme.CA(), named, "example.org")
    expired_at = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    expired, expired_key = write_pair(trustme.CA(), tmp_path, not_before=expired_at - datetime.timedelta(days=30),
                                      not_after=expired_at)
    for launcher, pair, words in (("local", (elsewhere, elsewhere_key), "not valid for '127.0.0.1'"),
                                  ("external", (expired, expired_key), "certificate has expired")):
        refused = subprocess.run(
            chunkline("stream-serve", TINY, "--port", "0", "--workers", launcher, "--cluster-port", "0",
                      "--cluster-tls-cert", str(pair[0]), "--cluster-tls-key", str(pair[1])),
            env=clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN), capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr, refused.stderr

    worker = subprocess.run(
        chunkline("worker", TINY, "--authority", "tls://127.0.0.1:9", "--tls-ca", str(tmp_path / "missing.pem")),
        env=clean_env(CHUNKLINE_CLUSTER_TOKEN=TOKEN), capture_output=True, text=True, timeout=120)
    assert worker.returncode == 2, worker.stderr
    assert "--tls-ca" in worker.stderr and "missing.pem" in worker.stderr and "Traceback" not in worker.stderr

"""TLS for the cluster wire: the authority's and the agents' contexts, each made once, the streams they wrap, and
the authority's self-check of its own certificate (:mod:`.wire` frames whatever stream it is given)."""

from __future__ import annotations

import re
import ssl

import trio

__all__ = ["certificate_problem", "client_tls_context", "server_tls_context", "ssl_detail", "wrap_client_tls",
           "wrap_server_tls"]


def ssl_detail(exc: BaseException) -> str:
    """An ssl (or OS) error's words without the C source line OpenSSL appends (``(_ssl.c:1006)``)."""
    return re.sub(r" \(_ssl\.c:\d+\)$", "", str(exc)) or type(exc).__name__


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The authority's TLS context, made once (not per connection: a flood must not make it read its key again);
    a ValueError naming both files if they are no certificate and its key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--cluster-tls-cert {cert_file!r} and --cluster-tls-key {key_file!r} are not a certificate "
                         f"and its private key: {ssl_detail(exc)}") from None
    return context


def certificate_problem(server: ssl.SSLContext, certificate_file: str, name: str | None) -> str | None:
    """Why an agent that trusts the authority's own certificate (as its launchers' agents do) would still refuse
    it: expired, not yet valid, or not naming ``name`` (the address they dial; None: not checked). One TLS
    handshake in memory, the authority's context against such an agent's; None when it would pass."""
    client = client_tls_context(certificate_file)
    if name is None:
        client.check_hostname = False
    agent_out, agent_in, authority_out, authority_in = (ssl.MemoryBIO() for _ in range(4))
    agent = client.wrap_bio(agent_in, agent_out, server_hostname=name)
    authority = server.wrap_bio(authority_in, authority_out, server_side=True)
    for _ in range(10):  # a handshake takes a few flights
        for side in (agent, authority):
            try:
                side.do_handshake()
            except ssl.SSLCertVerificationError as exc:
                return exc.verify_message or str(exc)
            except (ssl.SSLWantReadError, ssl.SSLError):
                pass  # wants the other side's bytes (an alert the agent sent ends it on the next turn)
        authority_in.write(agent_out.read())
        agent_in.write(authority_out.read())
    return None


def wrap_server_tls(stream: trio.abc.Stream, context: ssl.SSLContext) -> trio.SSLStream:
    return trio.SSLStream(stream, context, server_side=True)


def client_tls_context(ca_file: str | None) -> ssl.SSLContext:
    """An agent's TLS context, made once as it starts: a CA file it cannot read is a ValueError naming it then,
    not a failed dial every few seconds."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-ca {ca_file!r} is not a readable CA bundle: {exc}") from None
    # a certificate in the bundle is trusted as it is, a CA's or not: the authority's own (as its launchers pass it)
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def wrap_client_tls(stream: trio.abc.Stream, host: str, context: ssl.SSLContext) -> trio.SSLStream:
    return trio.SSLStream(stream, context, server_hostname=host)

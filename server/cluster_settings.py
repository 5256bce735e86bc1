"""The cluster's settings of the stream server (``chunkline stream-serve --workers local|ray|external``).

:class:`~server.settings.ServerSettings` holds them with the others; this module says which ``--workers`` each
applies to (:data:`WORKERS_ONLY`), where the agents' token comes from, and checks them together:

* The token agents prove is ``--cluster-token`` / ``CHUNKLINE_CLUSTER_TOKEN`` or the text of the file that
  ``--cluster-token-file`` / ``CHUNKLINE_CLUSTER_TOKEN_FILE`` names (a regular file of UTF-8 text, at most 4 KiB,
  read as ``chunkline worker --cluster-token-file`` reads it: :func:`server.setting_values.read_secret_file`, the
  same errors). A token on the command line is visible to the host's other users (``ps``); a file is not. A flag
  wins over the other source's variable (``--cluster-token-file`` over an exported ``CHUNKLINE_CLUSTER_TOKEN``, as
  for the worker command); the two flags, or the two variables, together are an error naming both.
* The agents' listener, addresses, token and heartbeats are refused with ``--workers in-process``,
  ``--ray-address`` with any ``--workers`` but ``ray``, and how the server's own workers run (worker mode, placement,
  GPU map, default fps, startup check, control idle timeout) with ``--workers external``, whose agents take their
  own: there they would be ignored. ``--cluster-token`` only when
  given on the command line (``CHUNKLINE_CLUSTER_TOKEN`` is often exported for a whole shell, the worker command
  reads it too); a token file is refused from either source, before it is read.

Every name here is importable from :mod:`server.settings` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .setting_values import SettingsError, env_var, option_for, read_secret_file

__all__ = ["AGENT_WORKERS", "MIN_CLUSTER_TOKEN_BYTES", "OWN_WORKERS", "SHELL_WIDE", "TOKEN_SOURCES", "WORKERS_ONLY", "check_cluster",
           "dialed_host", "one_token_source", "refuse_options_that_would_be_ignored"]

#: the --workers that run worker agents
AGENT_WORKERS = ("local", "ray", "external")
#: the --workers whose workers this server makes (in its process, or agents it launches with its own settings); an
#: external agent is started by its operator, with ``chunkline worker``'s own flags
OWN_WORKERS = ("in-process", "local", "ray")
#: settings that apply only to some --workers (agents' addresses, token and heartbeats; the Ray cluster; how the
#: server's own workers run): given with any other they would silently do nothing, so they are refused there, all by
#: this one table
WORKERS_ONLY: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("cluster_host", "cluster_port", "cluster_tls_cert", "cluster_tls_key", "public_url",
                     "cluster_token", "cluster_token_file", "heartbeat_interval", "heartbeat_deadline"), AGENT_WORKERS),
    "ray_address": ("ray",),
    **dict.fromkeys(("worker_mode", "placement", "worker_gpu_map", "default_fps", "skip_validation",
                     "control_idle_timeout"), OWN_WORKERS),
}
#: of those, the ones often exported for a whole shell: refused only when given on the command line
SHELL_WIDE = frozenset({"cluster_token"})
#: the two settings that give the agents' token: at most one of them at a time
TOKEN_SOURCES = ("cluster_token", "cluster_token_file")
MIN_CLUSTER_TOKEN_BYTES = 16


def dialed_host(host: str) -> str:
    """The address a launcher's agents dial for a listener on ``host`` (any address: this host's loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def refuse_options_that_would_be_ignored(settings: Any, given: frozenset[str], defaults: Mapping[str, Any],
                                         secrets: frozenset[str]) -> None:
    """A setting of :data:`WORKERS_ONLY` (among ``given``) that ``settings`` hold with a value other than its
    default (``defaults``), for --workers it does not apply to, would silently do nothing: refused, naming the
    option and what it applies to (its value too, unless it is one of ``secrets``)."""
    for name in sorted(given, key=list(WORKERS_ONLY).index):
        applies = WORKERS_ONLY[name]
        if settings.workers in applies or getattr(settings, name) == defaults[name]:
            continue
        option = option_for(name)
        value = getattr(settings, name)
        if name == "worker_gpu_map":  # as it is written, not as Python prints its tuples ('0;1', not ((0,), (1,)))
            value = ";".join(",".join(str(gpu) for gpu in group) for group in value)
        shown = "" if name in secrets or isinstance(value, bool) else f" ({value})"  # a flag's value: it was given
        where = "worker agents (--workers local, ray or external)" if applies == AGENT_WORKERS else (
            "the workers this server starts (--workers in-process, local or ray)" if applies == OWN_WORKERS else
            "--workers " + " or ".join(applies))
        then = (" (an external agent takes its own: chunkline worker --help)" if settings.workers == "external"
                else "")
        raise SettingsError(option, f"{option}{shown} applies to {where}; with --workers {settings.workers} it "
                                    f"would be ignored{then}")


def _both_given(where: str) -> SettingsError:
    token, token_file = (option_for(name) for name in TOKEN_SOURCES)
    return SettingsError(token_file, f"{token} and {token_file} both give the cluster token{where}; give one of them")


def one_token_source(values: dict[str, Any], from_env: dict[str, str], on_cli: frozenset[str]) -> None:
    """Of the two token sources in ``values`` (field name -> value, from the command line or the environment),
    keep one: a flag wins over the other's variable (its entry leaves ``values`` and ``from_env``, option ->
    variable); both from the environment is an error naming both variables (both flags: the settings' own)."""
    given = [name for name in TOKEN_SOURCES if name in values]
    if len(given) < 2:
        return
    flags = [name for name in given if name in on_cli]
    if len(flags) == 1:
        (beaten,) = set(given) - set(flags)
        values.pop(beaten)
        from_env.pop(option_for(beaten), None)
    elif not flags:
        raise _both_given(f" (from environment variables {' and '.join(env_var(name) for name in TOKEN_SOURCES)})")


def _token_from_file(path: str) -> str:
    option = option_for("cluster_token_file")
    token = read_secret_file(option, path)
    if len(token.encode()) < MIN_CLUSTER_TOKEN_BYTES:
        from .reasons import echo

        raise SettingsError(option, f"{option}: {echo(path, 80)} holds {len(token.encode())} bytes; a cluster token "
                                    f"is at least {MIN_CLUSTER_TOKEN_BYTES}")
    return token


def check_cluster(settings: Any) -> str | None:
    """Check the cluster settings of ``settings`` together (heartbeats, the listener's TLS pair, a token for
    external agents) and return the cluster token in force: ``cluster_token``, or the text of the file
    ``cluster_token_file`` names (read here, once the settings that would ignore it have been refused)."""
    if settings.heartbeat_deadline <= 2 * settings.heartbeat_interval:
        raise SettingsError(
            "--heartbeat-deadline",
            f"--heartbeat-deadline ({settings.heartbeat_deadline:g} s) must exceed twice --heartbeat-interval "
            f"({settings.heartbeat_interval:g} s), or one late heartbeat loses a healthy worker",
        )
    _check_tls(settings)
    token = settings.cluster_token
    if settings.cluster_token_file is not None:
        if token is not None:
            raise _both_given("")
        token = _token_from_file(settings.cluster_token_file)
    if settings.workers == "external" and token is None:
        sources = " or ".join(option_for(name) for name in TOKEN_SOURCES)
        variables = " or ".join(env_var(name) for name in TOKEN_SOURCES)
        raise SettingsError("--cluster-token", f"--workers external needs {sources} (or {variables}): the agents "
                                               f"prove it")
    return token


def _check_tls(settings: Any) -> None:
    if (settings.cluster_tls_cert is None) != (settings.cluster_tls_key is None):
        raise SettingsError("--cluster-tls-cert", "--cluster-tls-cert and --cluster-tls-key go together")
    if settings.cluster_tls_cert is None or settings.cluster_tls_key is None:
        return
    from .cluster.tls import certificate_problem, server_tls_context  # checked here, not as the port opens

    try:
        context = server_tls_context(settings.cluster_tls_cert, settings.cluster_tls_key)
    except ValueError as exc:
        raise SettingsError("--cluster-tls-cert", str(exc)) from None
    # the agents a launcher starts dial the cluster host; an external agent may know the authority by any name
    dialed = None if settings.workers == "external" else dialed_host(settings.cluster_host or settings.host)
    problem = certificate_problem(context, settings.cluster_tls_cert, dialed)
    if problem is not None:
        whose = f"the agents it starts dial tls://{dialed}" if dialed else "agents would refuse it"
        raise SettingsError("--cluster-tls-cert", f"--cluster-tls-cert {settings.cluster_tls_cert!r}: {problem} "
                                                  f"({whose})")

"""Settings of the stream server (``chunkline stream-serve``): one frozen, validated value.

:class:`ServerSettings` holds every knob of the server. Values come from three sources, in this order of
precedence (:meth:`ServerSettings.from_sources`):

1. command-line flags (``--queue-size 4``; a flag that is not given does not count);
2. ``CHUNKLINE_*`` environment variables (``CHUNKLINE_QUEUE_SIZE=4``);
3. the defaults below.

Every value may be given as text (the form flags and environment variables have) or as the Python value; text
is parsed here, so the CLI and the environment share one parser and one set of error messages. A bad value
raises :class:`SettingsError` (a ``ValueError``) whose ``option`` is the flag to fix (``"--queue-size"``) and
whose message names that flag and the bad value — never the value of a secret. When the bad value came from the
environment, the message also names the variable.

Environment variables (``CHUNKLINE_<FIELD NAME IN UPPER CASE>``):

====================================  ============================  ===================================================
variable                              flag                          default; accepted values
====================================  ============================  ===================================================
CHUNKLINE_PIPELINE                    PIPE (positional)             required: the pipeline file or package
CHUNKLINE_HOST                        --host                        ``127.0.0.1`` (see below)
CHUNKLINE_PORT                        --port / -p                   ``8088``; 1–65535, or 0 for any free port
CHUNKLINE_LIVEKIT_URL                 --livekit-url                 unset; a ``ws(s)://`` or ``http(s)://`` URL
CHUNKLINE_LIVEKIT_API_KEY             --livekit-api-key             unset
CHUNKLINE_LIVEKIT_API_SECRET          --livekit-api-secret          unset; at least 32 bytes
CHUNKLINE_TRANSPORT                   --transport                   ``livekit`` if a LiveKit URL is set, else ``local``
CHUNKLINE_NUM_WORKERS                 --num-workers                 ``1``; 1–64
CHUNKLINE_WORKER_GPU_MAP              --worker-gpu-map              unset; ``0,1;2,3``: one group per worker
CHUNKLINE_MAX_SESSIONS_PER_WORKER     --max-sessions-per-worker     ``auto``; ``auto`` or 1–64
CHUNKLINE_QUEUE_SIZE                  --queue-size                  ``0``; 0–10000
CHUNKLINE_CONTROL_IDLE_TIMEOUT        --control-idle-timeout        ``10`` s; > 0
CHUNKLINE_SESSION_TIMEOUT             --session-timeout             ``1800`` s; > 0
CHUNKLINE_TOKEN_TTL                   --token-ttl                   ``3600`` s; > 0
CHUNKLINE_CONTROLLER_TIMEOUT          --controller-timeout          ``60`` s; > 0
CHUNKLINE_ROOM_EMPTY_TIMEOUT          --room-empty-timeout          ``30`` s; > 0
CHUNKLINE_WORKER_MODE                 --worker-mode                 ``in-process``; or ``process``
CHUNKLINE_PLACEMENT                   --placement                   unset; a JSON placement file, or inline ``{...}``
CHUNKLINE_SKIP_VALIDATION             --skip-validation             ``false``; 1/0 true/false yes/no on/off
CHUNKLINE_ASSETS_DIR                  --assets-dir                  unset; an existing directory
CHUNKLINE_API_KEY                     --api-key                     unset (no auth); non-empty when set
CHUNKLINE_CORS_ALLOW_ORIGINS          --cors-allow-origins          unset: same origin only; ``a,b`` or ``*``
CHUNKLINE_DEFAULT_FPS                 --default-fps                 ``16``; 1–120
CHUNKLINE_MAX_DATA_MESSAGE_BYTES      --max-data-message-bytes      ``12288``; 1024–1048576
CHUNKLINE_MAX_BODY_BYTES              --max-body-bytes              ``8388608`` (8 MiB); 1024–64 MiB
CHUNKLINE_MAX_BODY_BYTES_IN_FLIGHT    --max-body-bytes-in-flight    ``134217728`` (128 MiB); max body–16 GiB
CHUNKLINE_SOCKET_SEND_BUFFER          --socket-send-buffer          ``262144`` (256 KiB); 16 KiB–4 MiB
CHUNKLINE_TERMINAL_RETENTION_SECONDS  --terminal-retention-seconds  ``3600`` s; > 0
CHUNKLINE_TERMINAL_RETENTION_COUNT    --terminal-retention-count    ``1000``; >= 0
CHUNKLINE_WORKERS                     --workers                     ``in-process``; or ``local``, ``ray``, ``external``
CHUNKLINE_CLUSTER_HOST                --cluster-host                unset: ``--host``; the agents' listener
CHUNKLINE_CLUSTER_PORT                --cluster-port                ``0`` (any free port); 0–65535
CHUNKLINE_CLUSTER_TOKEN               --cluster-token               unset (local/ray make one); >= 16 bytes
CHUNKLINE_CLUSTER_TOKEN_FILE          --cluster-token-file          unset; a file holding the token (not with the token)
CHUNKLINE_CLUSTER_TLS_CERT            --cluster-tls-cert            unset; a PEM file (with the key: TLS to agents)
CHUNKLINE_CLUSTER_TLS_KEY             --cluster-tls-key             unset; a PEM file
CHUNKLINE_PUBLIC_URL                  --public-url                  unset: the bound address; ``http://HOST:PORT``
CHUNKLINE_HEARTBEAT_INTERVAL          --heartbeat-interval          ``1`` s; > 0
CHUNKLINE_HEARTBEAT_DEADLINE          --heartbeat-deadline          ``5`` s; > 2 x the interval
CHUNKLINE_RAY_ADDRESS                 --ray-address                 unset: a local Ray; or ``HOST:PORT`` / ``auto``
====================================  ============================  ===================================================

Notes:

* ``host`` defaults to ``127.0.0.1``, a safer default than the reference server's ``0.0.0.0``: pass
  ``--host 0.0.0.0`` to expose the server on every interface.
* Prefer the environment for secrets (``CHUNKLINE_API_KEY``, ``CHUNKLINE_LIVEKIT_API_SECRET``): command-line
  arguments are visible to other users of the machine. Secrets never appear in ``repr()`` or
  :meth:`ServerSettings.public_dict`.
* A blank LiveKit URL/key/secret, GPU map or CORS list means "not set" (as in the reference); a blank API key,
  assets directory or pipeline is an error.
* ``transport=livekit`` needs all three of the LiveKit URL, key and secret; the error names the missing ones.
* A GPU id may belong to only one worker group; the number of groups must equal ``num_workers``.
* ``cors_allow_origins`` defaults to no origin (same origin only), not ``*``; ``max_body_bytes`` bounds request
  bodies (larger ones get HTTP 413), and ``max_body_bytes_in_flight`` the bodies of all connections still
  arriving at once (the front answers one more 503 with ``Retry-After``); it must be at least ``max_body_bytes``.
* ``socket_send_buffer`` is each client connection's kernel send buffer (``SO_SNDBUF``; the kernel doubles it, and
  caps it at ``net.core.wmem_max``, 212992 on a stock kernel): what the server's kernel may hold for one client, and per round trip the most a
  connection carries. Raise it for large streams over long links (see :data:`server.front.SEND_BUFFER_BYTES`).
* The agents' listener, addresses, token (or token file) and heartbeats are refused with ``workers=in-process``,
  ``ray_address`` with any ``workers`` but ``ray``: there they would be ignored (one table, ``WORKERS_ONLY``); a flag
  of the two token sources wins over the other's variable. See :mod:`server.cluster_settings`. So are LiveKit's URL
  and keys given on the command line with the local transport (``--livekit-api-key`` alone, or any of them with
  ``--transport local``).
* ``session_timeout`` expires sessions, ``controller_timeout`` / ``room_empty_timeout`` bound how long a room
  waits for its controller / sits empty, and ``terminal_retention_seconds`` / ``terminal_retention_count`` bound
  how long and how many finished session records are kept (the reference kept them forever).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from . import setting_fields as fields
from .cluster_settings import (
    AGENT_WORKERS,
    SHELL_WIDE,
    WORKERS_ONLY,
    check_cluster,
    dialed_host,
    one_token_source,
    refuse_options_that_would_be_ignored,
)
from .setting_fields import MIN_LIVEKIT_SECRET_BYTES
from .setting_values import (
    ENV_PREFIX,
    GpuMap,
    SettingsError,
    blank_to_none,
    env_var,
    option_for,
    parse_bool,
    parse_choice,
    parse_cors_origins,
    parse_float,
    parse_gpu_map,
    parse_int,
)

__all__ = [
    "AGENT_WORKERS",
    "ENV_PREFIX",
    "MIN_LIVEKIT_SECRET_BYTES",
    "ServerSettings",
    "SHELL_WIDE",
    "SettingsError",
    "WORKERS_ONLY",
    "dialed_host",
    "env_var",
    "option_for",
    "parse_cors_origins",
    "parse_gpu_map",
]

REDACTED = "***"

#: ``CHUNKLINE_*`` variables that are not server settings (the worker command's token, the LiveKit binary, the tests'
#: and the benchmarks' own): any other is most likely a misspelt setting, which the server would ignore unseen.
OTHER_VARIABLES = frozenset({
    "CHUNKLINE_CLUSTER_TOKEN", "CHUNKLINE_LIVEKIT_SERVER", "CHUNKLINE_ARTIFACTS", "CHUNKLINE_CHROMIUM",
    "CHUNKLINE_CHROMEDRIVER", "CHUNKLINE_PEER_ORCHESTRATOR", "CHUNKLINE_BENCH_SIZE", "CHUNKLINE_TEST_GPU_RECORD",
})
MAX_DATA_MESSAGE_LIMIT = 1024 * 1024  # a control is a few hundred bytes; LiveKit's data packets are far smaller
MAX_BODY_LIMIT = 64 * 1024 * 1024  # every body is read into memory before it is answered
MAX_BODIES_IN_FLIGHT_LIMIT = 16 * 1024 * 1024 * 1024  # what all arriving bodies together may hold
MAX_SEND_BUFFER = 4 * 1024 * 1024  # Linux's default net.core.wmem_max, and what its autotuning grew a buffer to
DEFAULT_SEND_BUFFER = 256 * 1024  # why this much: server.front.SEND_BUFFER_BYTES
MIN_TOKEN_TTL = 5.0  # seconds: the worker joins its room with a token of this TTL too
MAX_TOKEN_TTL = 365 * 24 * 3600.0  # a year: far beyond any session, and well before expiries stop being writable

SECRETS = frozenset({"livekit_api_secret", "api_key", "cluster_token"})  # a token file's path is not one
#: LiveKit's address and keys: given on the command line with the local transport, they are refused
LIVEKIT = ("livekit_url", "livekit_api_key", "livekit_api_secret")

Transport = Literal["local", "livekit"]
WorkerMode = Literal["in-process", "process"]
Workers = Literal["in-process", "local", "ray", "external"]


def _secret_repr(value: str | None) -> str:
    return "None" if value is None else repr(REDACTED)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@attrs.frozen(kw_only=True)
class ServerSettings:
    """Every setting of the stream server, validated. Construct directly or with :meth:`from_sources`."""

    pipeline: str = attrs.field(converter=fields.pipeline_path, metadata=_help("pipeline file or package"))
    host: str = attrs.field(
        default="127.0.0.1",
        converter=fields.host_name,
        metadata=_help("interface to listen on (use 0.0.0.0 to expose on every interface)"),
    )
    port: int = attrs.field(
        default=8088,
        converter=lambda v: parse_int("--port", v, 0, 65535),
        metadata=_help("TCP port to listen on (0: any free port)"),
    )
    livekit_url: str | None = attrs.field(
        default=None,
        converter=fields.livekit_url,
        metadata=_help("LiveKit server URL (ws://, wss://, http:// or https://)"),
    )
    livekit_api_key: str | None = attrs.field(
        default=None, converter=fields.livekit_api_key, metadata=_help("LiveKit API key")
    )
    livekit_api_secret: str | None = attrs.field(
        default=None,
        converter=fields.livekit_api_secret,
        metadata=_help(
            f"LiveKit API secret, at least {MIN_LIVEKIT_SECRET_BYTES} bytes (prefer the environment variable)"
        ),
        repr=_secret_repr,
    )
    #: ``None`` only before construction finishes: resolved to "livekit" when a LiveKit URL is set, else "local".
    transport: Transport = attrs.field(
        default=None, converter=fields.transport_name, metadata=_help("media transport: local or livekit")
    )
    num_workers: int = attrs.field(
        default=1, converter=lambda v: parse_int("--num-workers", v, 1, 64), metadata=_help("number of workers (1-64)")
    )
    worker_gpu_map: GpuMap | None = attrs.field(
        default=None,
        converter=parse_gpu_map,
        metadata=_help("GPUs per worker, e.g. '0,1;2,3' (';' between workers, ',' between GPUs)"),
    )
    max_sessions_per_worker: int | Literal["auto"] = attrs.field(
        default="auto", converter=fields.max_sessions, metadata=_help("sessions per worker: auto (from memory) or 1-64")
    )
    queue_size: int = attrs.field(
        default=0,
        converter=lambda v: parse_int("--queue-size", v, 0, 10000),
        metadata=_help("sessions that may wait for capacity (0-10000)"),
    )
    control_idle_timeout: float = attrs.field(
        default=10.0,
        converter=lambda v: parse_float("--control-idle-timeout", v, 0.0, lo_open=True),
        metadata=_help("seconds without controls after which a session is idle and steps aside for a session waiting "
                       "for the execution lease (offered to a pipeline that takes control_idle_timeout)"),
    )
    session_timeout: float = attrs.field(
        default=1800.0,
        converter=lambda v: parse_float("--session-timeout", v, 0.0, lo_open=True),
        metadata=_help("seconds a session may live"),
    )
    token_ttl: float = attrs.field(
        default=3600.0,
        # past year 9999 an expiry cannot be written (every create was a 500); under a few seconds the
        # worker's own token expired before it joined (every session failed)
        converter=lambda v: parse_float("--token-ttl", v, MIN_TOKEN_TTL, MAX_TOKEN_TTL),
        metadata=_help("seconds a room access token is valid (5 s to 365 days)"),
    )
    controller_timeout: float = attrs.field(
        default=60.0,
        converter=lambda v: parse_float("--controller-timeout", v, 0.0, lo_open=True),
        metadata=_help("seconds a new room waits for its controller"),
    )
    room_empty_timeout: float = attrs.field(
        default=30.0,
        converter=lambda v: parse_float("--room-empty-timeout", v, 0.0, lo_open=True),
        metadata=_help("seconds a room may stay empty before its session ends"),
    )
    worker_mode: WorkerMode = attrs.field(
        default="in-process", converter=fields.worker_mode, metadata=_help("in-process or process workers")
    )
    placement: str | None = attrs.field(
        default=None,
        converter=fields.placement,
        metadata=_help("where each pipeline stage runs: a JSON placement file or inline JSON (see the pipeline)"),
    )
    skip_validation: bool = attrs.field(
        default=False,
        converter=lambda v: parse_bool("--skip-validation", v),
        metadata=_help("skip the startup check of the pipeline (one warm-up chunk checked against the contract)"),
    )
    assets_dir: str | None = attrs.field(
        default=None, converter=fields.assets_dir, metadata=_help("folder a create's image_path is looked up in")
    )
    api_key: str | None = attrs.field(
        default=None,
        converter=fields.api_key,
        metadata=_help("require this key on API requests (prefer the environment variable)"),
        repr=_secret_repr,
    )
    cors_allow_origins: tuple[str, ...] = attrs.field(
        default=(), converter=parse_cors_origins, metadata=_help("comma-separated origins allowed by CORS, or *")
    )
    default_fps: float = attrs.field(
        default=16.0,
        converter=lambda v: parse_float("--default-fps", v, 1.0, 120.0),
        metadata=_help("frame rate offered to a pipeline that takes an fps and is given none (1-120)"),
    )
    max_data_message_bytes: int = attrs.field(
        default=12288,
        converter=lambda v: parse_int("--max-data-message-bytes", v, 1024, MAX_DATA_MESSAGE_LIMIT),
        metadata=_help("largest data message (1024-1048576)"),
    )
    max_body_bytes: int = attrs.field(
        default=8 * 1024 * 1024,
        converter=lambda v: parse_int("--max-body-bytes", v, 1024, MAX_BODY_LIMIT),
        metadata=_help(f"largest HTTP request body; larger ones get 413 (1024-{MAX_BODY_LIMIT})"),
    )
    max_body_bytes_in_flight: int = attrs.field(
        default=128 * 1024 * 1024,
        converter=lambda v: parse_int("--max-body-bytes-in-flight", v, 1024, MAX_BODIES_IN_FLIGHT_LIMIT),
        metadata=_help(
            "request body bytes all connections together may have arriving at once (by their Content-Length); "
            f"one more gets 503 with Retry-After (--max-body-bytes to {MAX_BODIES_IN_FLIGHT_LIMIT})"
        ),
    )
    socket_send_buffer: int = attrs.field(
        default=DEFAULT_SEND_BUFFER,
        converter=lambda v: parse_int("--socket-send-buffer", v, 16 * 1024, MAX_SEND_BUFFER),
        metadata=_help(
            "each client connection's kernel send buffer (SO_SNDBUF): what the kernel holds for one client; raise it "
            f"for large streams over long links ({16 * 1024}-{MAX_SEND_BUFFER})"
        ),
    )
    terminal_retention_seconds: float = attrs.field(
        default=3600.0,
        converter=lambda v: parse_float("--terminal-retention-seconds", v, 0.0, lo_open=True),
        metadata=_help("seconds finished session records are kept"),
    )
    terminal_retention_count: int = attrs.field(
        default=1000,
        converter=lambda v: parse_int("--terminal-retention-count", v, 0, None),
        metadata=_help("most finished session records kept (>= 0)"),
    )

    workers: Workers = attrs.field(
        default="in-process",
        converter=lambda v: parse_choice("--workers", v, ("in-process", "local", "ray", "external")),
        metadata=_help("where model workers run: in-process, local (agent processes on this host), ray, or external agents"),
    )
    cluster_host: str | None = attrs.field(
        default=None,
        converter=lambda v: None if blank_to_none(v) is None else fields.host_name(v),
        metadata=_help("interface the agents' listener binds (default: --host)"),
    )
    cluster_port: int = attrs.field(
        default=0,
        converter=lambda v: parse_int("--cluster-port", v, 0, 65535),
        metadata=_help("TCP port worker agents dial (0: any free port; give one for external agents)"),
    )
    cluster_token: str | None = attrs.field(
        default=None,
        converter=fields.cluster_token,
        metadata=_help("shared secret agents prove at registration, >= 16 bytes (local and ray make one when unset)"),
        repr=_secret_repr,
    )
    cluster_token_file: str | None = attrs.field(
        default=None,
        converter=fields.secret_file("--cluster-token-file"),
        metadata=_help("read the cluster token from this file, not --cluster-token (a regular file of UTF-8 text, "
                       "at most 4 KiB)"),
    )
    cluster_tls_cert: str | None = attrs.field(
        default=None, converter=fields.existing_file("--cluster-tls-cert"), metadata=_help("TLS certificate of the agents' listener")
    )
    cluster_tls_key: str | None = attrs.field(
        default=None, converter=fields.existing_file("--cluster-tls-key"), metadata=_help("TLS private key of the agents' listener")
    )
    public_url: str | None = attrs.field(
        default=None,
        converter=lambda v: None if blank_to_none(v) is None else fields.public_url(v),
        metadata=_help("this server's http://HOST:PORT as agents on other hosts reach it (local rooms)"),
    )
    heartbeat_interval: float = attrs.field(
        default=1.0,
        converter=lambda v: parse_float("--heartbeat-interval", v, 0.0, lo_open=True),
        metadata=_help("seconds between an agent's heartbeats"),
    )
    heartbeat_deadline: float = attrs.field(
        default=5.0,
        converter=lambda v: parse_float("--heartbeat-deadline", v, 0.0, lo_open=True),
        metadata=_help("seconds without word from an agent before it is lost (> 2 x the interval)"),
    )
    ray_address: str | None = attrs.field(
        default=None,
        converter=blank_to_none,
        metadata=_help("Ray cluster to place agents on (--workers ray; default: start a local Ray)"),
    )

    def __attrs_post_init__(self) -> None:
        self._refuse_options_that_would_be_ignored(given=frozenset(WORKERS_ONLY) - SHELL_WIDE)
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise SettingsError(
                "--max-body-bytes-in-flight",
                f"--max-body-bytes-in-flight ({self.max_body_bytes_in_flight}) must be at least --max-body-bytes "
                f"({self.max_body_bytes}), or a body of the largest size could never be taken",
            )
        object.__setattr__(self, "cluster_token", check_cluster(self))  # read from its file when one is named
        self._refuse_a_cluster_port_on_the_http_port()
        if self.transport is None:
            object.__setattr__(self, "transport", "livekit" if self.livekit_url is not None else "local")
        if self.transport == "livekit":
            missing = [name for name in LIVEKIT if getattr(self, name) is None]
            if missing:
                flags = ", ".join(option_for(name) for name in missing)
                envs = ", ".join(env_var(name) for name in missing)
                raise SettingsError(
                    option_for(missing[0]),
                    f"--transport livekit needs {flags} (or {envs}); use --transport local to run without LiveKit",
                )
        if self.worker_gpu_map is not None and len(self.worker_gpu_map) != self.num_workers:
            raise SettingsError(
                "--worker-gpu-map",
                f"--worker-gpu-map has {len(self.worker_gpu_map)} worker group(s) but --num-workers is "
                f"{self.num_workers}; give one group per worker",
            )

    def _refuse_a_cluster_port_on_the_http_port(self) -> None:
        """The agents' port is not the HTTP one (it was refused as "Address already in use", not saying whose)."""
        wildcard = ("0.0.0.0", "::")
        cluster_host = self.cluster_host or self.host
        overlap = cluster_host == self.host or cluster_host in wildcard or self.host in wildcard
        if self.cluster_port and self.cluster_port == self.port and overlap:
            raise SettingsError(
                "--cluster-port",
                f"--cluster-port {self.cluster_port} is the server's own --port: agents dial a port of their own; "
                f"give --cluster-port another (0: any free one)",
            )

    def _refuse_options_that_would_be_ignored(self, given: frozenset[str]) -> None:
        """A setting of :data:`WORKERS_ONLY` (among ``given``) set for --workers it does not apply to would silently
        do nothing: refused, naming the option and what it applies to."""
        defaults = {field.name: field.default for field in attrs.fields(type(self))}
        refuse_options_that_would_be_ignored(self, given, defaults, SECRETS)

    # --- sources --------------------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in attrs.fields(cls))

    @classmethod
    def from_sources(cls, cli: Mapping[str, Any], env: Mapping[str, str]) -> ServerSettings:
        """Build settings from CLI values over ``CHUNKLINE_*`` environment variables over defaults.

        ``cli`` maps field names to values, ``None`` meaning "not given" (``vars()`` of the parsed arguments;
        its ``command`` key is ignored, any other unknown key is a ``TypeError``). ``env`` is the environment
        (``os.environ``); only ``CHUNKLINE_<FIELD>`` variables are read. Raises :class:`SettingsError`.
        """
        names = cls.field_names()
        unknown = sorted(set(cli) - set(names) - {"command"})
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        from_env: dict[str, str] = {}
        for name in names:
            given = cli.get(name)
            if given is not None:
                values[name] = given
            elif env_var(name) in env:
                values[name] = env[env_var(name)]
                from_env[option_for(name)] = env_var(name)
        one_token_source(values, from_env, frozenset(name for name in names if cli.get(name) is not None))
        if "pipeline" not in values:
            fields.pipeline_path(None)  # raises, naming PIPE and CHUNKLINE_PIPELINE
        try:
            settings = cls(**values)
        except SettingsError as exc:
            variable = from_env.get(exc.option)
            if variable is None or variable in str(exc):
                raise
            raise SettingsError(exc.option, f"{exc} (from environment variable {variable})") from None
        settings._refuse_options_that_would_be_ignored(given=frozenset(n for n in SHELL_WIDE if cli.get(n) is not None))
        settings._refuse_livekit_options_on_the_local_transport(given=frozenset(n for n in LIVEKIT if cli.get(n) is not None))
        return settings

    def _refuse_livekit_options_on_the_local_transport(self, given: frozenset[str]) -> None:
        """LiveKit's address and keys on the command line would do nothing on the local transport (exported for a
        whole shell, they may be there: ``--transport local`` is how to run without them)."""
        if self.transport == "local" and given:
            option = option_for(min(given, key=LIVEKIT.index))
            raise SettingsError(option, f"{option} applies to --transport livekit; with --transport local it would be ignored")

    @classmethod
    def ignored_variables(cls, env: Mapping[str, str]) -> list[str]:
        """A warning for each ``CHUNKLINE_*`` variable in ``env`` that nothing reads, naming the setting it may
        have meant (``CHUNKLINE_QUEUE_SIZ`` -> ``CHUNKLINE_QUEUE_SIZE``): a misspelt one changed nothing, silently."""
        known = sorted({env_var(name) for name in cls.field_names()} | OTHER_VARIABLES)
        warnings = []
        for variable in sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known):
            close = difflib.get_close_matches(variable, known, n=1, cutoff=0.8)
            meant = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"{variable} is not a chunkline setting{meant}; it is ignored")
        return warnings

    # --- views ----------------------------------------------------------------------------------------------

    def public_dict(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict, with the LiveKit secret and the API key shown as ``"***"``."""
        out: dict[str, Any] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if field.name in SECRETS and value is not None:
                value = REDACTED
            elif field.name == "worker_gpu_map" and value is not None:
                value = [list(group) for group in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out

    def redacted(self) -> dict[str, Any]:
        """Same as :meth:`public_dict`: safe to log."""
        return self.public_dict()

    @property
    def livekit_configured(self) -> bool:
        return None not in (self.livekit_url, self.livekit_api_key, self.livekit_api_secret)

"""The ``chunkline`` command's arguments: ``run``, ``stream-serve`` and ``worker`` (see :mod:`server.cli`)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["DEFAULT_CHUNKS", "DEFAULT_OUT", "build_parser"]

DEFAULT_CHUNKS = 8
DEFAULT_OUT = "chunkline-run"


def _seed(text: str) -> int:
    """A seed torch takes (a signed 64-bit int that is not negative): said before the run, naming the flag."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: a seed is 0 to 2**63-1")
    return value


def _count(text: str) -> int:
    """An integer in plain digits (its range is the run's to check, naming the flag): one too long to show is shown
    cut. Python's own ``int`` also took ``1_0`` (10), `` 2 `` and digits of other scripts (``٢``, 2)."""
    try:
        if not _PLAIN_INTEGER.fullmatch(text):
            raise ValueError(text)
        return int(text)
    except ValueError:
        shown = repr(text) if len(text) <= 80 else f"{text[:80]!r}... ({len(text)} characters in all)"
        raise argparse.ArgumentTypeError(f"not an integer: {shown}") from None


_PLAIN_INTEGER = re.compile(r"[+-]?[0-9]+")


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line naming the command (``chunkline run: error: ...``) and exit code 2:
    argparse printed the whole usage first (35 lines for stream-serve), and an unknown argument after a command was
    told as the top command's (``chunkline: error: unrecognized arguments``, under ``chunkline``'s usage). A flag is
    taken by its whole name only (``--chunk 3`` ran 3 chunks, and a flag added later could have made it another's)."""

    commands: dict[str, argparse.ArgumentParser]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        from .console import tell

        tell(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(2)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser() -> Parser:
    parser = Parser(
        prog="chunkline",
        description="Serve interactive, stateful, chunked generation.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = commands.choices
    _add_stream_serve_parser(commands)
    from server.cluster.worker_cli import add_worker_parser

    add_worker_parser(commands)

    run = commands.add_parser(
        "run",
        help="run a pipeline offline: write video.mp4 and metrics.json",
        description="Run one session of a pipeline offline and write OUT/video.mp4 and OUT/metrics.json.",
        epilog=(
            "Ctrl-C (or SIGTERM) stops the run in order, and so do SIGHUP (its terminal closed) and SIGQUIT "
            "(Ctrl-\\): the pipeline closes its session, no output is left, exit code 130 (143 for SIGTERM, 129 "
            "for SIGHUP, 131 for SIGQUIT). That can wait for a "
            "hung stage up to the pipeline's close deadline (a pipeline that holds trio's thread ends the run 2 s "
            "after the signal); a second Ctrl-C (or SIGTERM) aborts at once, also leaving no output."
        ),
    )
    run.add_argument("pipeline", help="path of a pipeline file or package defining get_service()")
    run.add_argument("--image", metavar="FILE", help="reference image for the session (SessionConfig.image_path)")
    run.add_argument("--prompt", metavar="TEXT", help="text prompt for the session")
    run.add_argument(
        "--controls", metavar="FILE", help="timed controls, a JSON list (see pipelines/timed_controls.py for the format)"
    )
    run.add_argument(
        "--chunks", metavar="N", type=_count, default=DEFAULT_CHUNKS, help=f"chunks to generate (default {DEFAULT_CHUNKS})"
    )
    run.add_argument("--device", choices=("cpu", "cuda"), help="device for the pipeline (passed to get_service)")
    run.add_argument(
        "--placement",
        metavar="FILE|JSON",
        help="where each stage runs: a JSON placement file or inline JSON (passed to get_service; not with --device)",
    )
    run.add_argument("--seed", metavar="N", type=_seed, help="random seed, 0 to 2**63-1 (passed to get_service)")
    run.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                     help=f"output directory, made if missing (default {DEFAULT_OUT}); a video.mp4 and a metrics.json "
                          f"already in it are replaced when the run succeeds, and left as they were when it does not")
    run.add_argument(
        "--option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a session option (SessionConfig.options), once per KEY; VALUE is read as JSON when it parses, else as "
             "text",
    )
    return parser


# metavars of the stream-serve flags; every flag takes text that server.settings parses (so that flags and
# environment variables share one parser and one set of messages) and defaults to None (= not given).
_SERVE_METAVARS: dict[str, str] = {
    "host": "HOST",
    "port": "N",
    "transport": "local|livekit",
    "livekit_url": "URL",
    "livekit_api_key": "KEY",
    "livekit_api_secret": "SECRET",
    "num_workers": "N",
    "worker_gpu_map": "MAP",
    "max_sessions_per_worker": "auto|N",
    "queue_size": "N",
    "worker_mode": "in-process|process",
    "placement": "FILE|JSON",
    "assets_dir": "DIR",
    "api_key": "KEY",
    "cors_allow_origins": "ORIGINS",
    "default_fps": "FPS",
    "max_data_message_bytes": "BYTES",
    "max_body_bytes": "BYTES",
    "max_body_bytes_in_flight": "BYTES",
    "socket_send_buffer": "BYTES",
    "terminal_retention_count": "N",
    "workers": "in-process|local|ray|external",
    "cluster_host": "HOST",
    "cluster_port": "N",
    "cluster_token": "TOKEN",
    "cluster_token_file": "FILE",
    "cluster_tls_cert": "FILE",
    "cluster_tls_key": "FILE",
    "public_url": "URL",
    "ray_address": "ADDRESS",
}


def _add_stream_serve_parser(commands: Any) -> argparse.ArgumentParser:
    import attrs

    from server.settings import ServerSettings, env_var, option_for

    serve = commands.add_parser(
        "stream-serve",
        help="run the stream server for a pipeline file",
        description=(
            "Run the stream server for a pipeline. Every option can also be set with a CHUNKLINE_* environment "
            "variable (shown with each option); options win over the environment, which wins over the defaults."
        ),
    )
    serve.add_argument(
        "pipeline",
        metavar="PIPE",
        nargs="?",
        default=None,
        help=f"path of a pipeline file or package defining get_service() (env {env_var('pipeline')})",
    )
    for field in attrs.fields(ServerSettings):
        if field.name == "pipeline":
            continue
        flags = [option_for(field.name)] + (["-p"] if field.name == "port" else [])
        if field.name == "transport":
            shown = "livekit when a LiveKit URL is set, else local"
        elif field.name == "cors_allow_origins":
            shown = "none: same origin only"
        elif field.default is None:
            shown = "unset"
        else:
            shown = str(field.default).lower() if isinstance(field.default, bool) else str(field.default)
        help_text = f"{field.metadata['help']} (default {shown}; env {env_var(field.name)})"
        if field.default is None and "default" in field.metadata["help"]:  # said there: "(default: --host)"
            help_text = f"{field.metadata['help']} (env {env_var(field.name)})"
        if field.type in (bool, "bool"):
            serve.add_argument(
                *flags, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            metavar = _SERVE_METAVARS.get(field.name, "SECONDS" if isinstance(field.default, float) else "VALUE")
            serve.add_argument(*flags, dest=field.name, metavar=metavar, default=None, help=help_text)
    return serve

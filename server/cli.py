"""The ``chunkline`` command line.

``chunkline run PIPE [--image FILE] [--prompt TEXT] [--controls FILE] [--chunks N] [--device cpu|cuda]
[--placement FILE|JSON] [--seed N] [--out DIR] [--option KEY=VALUE ...]`` runs a pipeline offline (see :mod:`pipelines.offline`):
it writes ``DIR/video.mp4`` and ``DIR/metrics.json``, draws a progress bar on stderr and prints a summary on
stdout. Bad input (a missing pipeline, image or controls file, a malformed controls file, an unknown control,
an unsupported device, options the pipeline refuses) is reported on stderr with exit code 2 and leaves no
output behind; a run that fails later exits 1, also without output files, and so does a pipeline that breaks
the contract (a chunk that is not a Chunk or not uint8, indexes that skip, a session id that is not a str): a
pipeline bug, never bad input. The first Ctrl-C (SIGINT) or
SIGTERM stops the run in order: the pipeline closes its session and stages, no output is left, and the exit
code is 130 (SIGINT) or 143 (SIGTERM); a stage that hangs can make that stop last as long as the pipeline's
close deadline, so a second Ctrl-C or SIGTERM aborts at once (no output is left; the exit code is the first
signal's, 130 after Ctrl-C) without waiting for the pipeline (:mod:`server.run_signals`).

``--placement`` (both commands; ``CHUNKLINE_PLACEMENT`` for stream-serve) names a JSON placement file, or
is inline JSON starting with ``{``: where each stage runs (format: :mod:`pipelines.toy_world.placement`).
It is passed to ``get_service(placement=...)`` and only to pipelines whose ``get_service`` has a
``placement`` parameter; an impossible placement is refused at startup naming the stage (exit code 2).

``chunkline stream-serve [PIPE] [--host H] [--port N] [--transport local|livekit] [--livekit-url URL] ...``
runs the stream server (:func:`server.serve.run`). Every setting of :class:`server.settings.ServerSettings` has
a ``--kebab-case`` flag and a ``CHUNKLINE_*`` environment variable (the table is in :mod:`server.settings`);
flags win over the environment, which wins over the defaults. ``PIPE`` may come from ``CHUNKLINE_PIPELINE``.
A bad value is reported as ``chunkline stream-serve: error: <message naming the option>`` with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chunkline",
        description="Serve interactive, stateful, chunked generation.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_stream_serve_parser(commands)
    from server.cluster.worker_cli import add_worker_parser

    add_worker_parser(commands)

    run = commands.add_parser(
        "run",
        help="run a pipeline offline: write video.mp4 and metrics.json",
        description="Run one session of a pipeline offline and write OUT/video.mp4 and OUT/metrics.json.",
        epilog=(
            "Ctrl-C (or SIGTERM) stops the run in order: the pipeline closes its session, no output is left, "
            "exit code 130 (143 for SIGTERM). That can wait for a hung stage up to the pipeline's close "
            "deadline; a second Ctrl-C (or SIGTERM) aborts at once, also leaving no output."
        ),
    )
    run.add_argument("pipeline", help="path of a pipeline file or package defining get_service()")
    run.add_argument("--image", metavar="FILE", help="reference image for the session (SessionConfig.image_path)")
    run.add_argument("--prompt", metavar="TEXT", help="text prompt for the session")
    run.add_argument(
        "--controls", metavar="FILE", help="timed controls, a JSON list (see pipelines/timed_controls.py for the format)"
    )
    run.add_argument(
        "--chunks", metavar="N", type=int, default=DEFAULT_CHUNKS, help=f"chunks to generate (default {DEFAULT_CHUNKS})"
    )
    run.add_argument("--device", choices=("cpu", "cuda"), help="device for the pipeline (passed to get_service)")
    run.add_argument(
        "--placement",
        metavar="FILE|JSON",
        help="where each stage runs: a JSON placement file or inline JSON (passed to get_service; not with --device)",
    )
    run.add_argument("--seed", metavar="N", type=_seed, help="random seed, 0 to 2**63-1 (passed to get_service)")
    run.add_argument("--out", metavar="DIR", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    run.add_argument(
        "--option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a session option (SessionConfig.options); VALUE is read as JSON when it parses, else as text",
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
    "terminal_retention_count": "N",
    "workers": "in-process|local|ray|external",
    "cluster_host": "HOST",
    "cluster_port": "N",
    "cluster_token": "TOKEN",
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
        if field.type in (bool, "bool"):
            serve.add_argument(
                *flags, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            metavar = _SERVE_METAVARS.get(field.name, "SECONDS" if isinstance(field.default, float) else "VALUE")
            serve.add_argument(*flags, dest=field.name, metavar=metavar, default=None, help=help_text)
    return serve


def parse_stream_serve_args(argv: Sequence[str], env: Mapping[str, str]) -> Any:
    """Parse ``chunkline stream-serve`` arguments (the words after ``stream-serve``; a leading
    ``"stream-serve"`` is skipped) with ``env`` as the environment, and return the
    :class:`server.settings.ServerSettings`. Raises ``SettingsError`` for a bad value and ``SystemExit(2)``
    for arguments argparse refuses (an unknown flag, a flag without its value).
    """
    from server.settings import ServerSettings

    words = list(argv)
    if words[:1] != ["stream-serve"]:
        words.insert(0, "stream-serve")
    args = build_parser().parse_args(words)
    return ServerSettings.from_sources(vars(args), env)


def _cmd_stream_serve(args: argparse.Namespace) -> int:
    from server.setting_fields import require_existing_pipeline
    from server.settings import ServerSettings, SettingsError

    prefix = "chunkline stream-serve"
    try:
        settings = ServerSettings.from_sources(vars(args), os.environ)
        require_existing_pipeline(settings.pipeline, None if args.pipeline else "CHUNKLINE_PIPELINE")
    except SettingsError as exc:
        print(f"{prefix}: error: {exc}", file=sys.stderr)
        return 2
    for warning in ServerSettings.ignored_variables(os.environ):
        print(f"{prefix}: warning: {warning}", file=sys.stderr)
    serve = importlib.import_module("server.serve")  # lazily: `chunkline run` never loads the server stack
    try:
        result = serve.run(settings)
    except SettingsError as exc:  # a --host/--port (or cluster address) it cannot listen on
        print(f"{prefix}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0


class _BadInput(Exception):
    """Input the user can fix: reported on stderr with exit code 2."""


class ProgressBar:
    """A ``\\r``-updated text progress bar on a terminal: ``[#######.......]  3/8 chunks  1.2 s``; elsewhere (a log
    file, a pipe) a plain line for chunks 1-10, 20, 30... 100, 200...: a bar redrawn per chunk filled logs with
    frames."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._drawn = False
        self._started = time.perf_counter()
        self._terminal = stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self._started
        count = f"{done:>{len(str(total))}}/{total} chunks  {elapsed:6.1f} s"
        if not self._terminal:
            # 1-10, then every 10 up to 100, every 100 up to 1,000...: some ten lines a tenfold, and the last
            if done == total or done % 10 ** max(0, len(str(done)) - 1) == 0:
                self._stream.write(count + "\n")
                self._stream.flush()
            return
        filled = min(self._width, round(self._width * done / total)) if total else self._width
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r[{bar}] {count}")
        self._stream.flush()
        self._drawn = True

    @property
    def drawn(self) -> bool:
        """A bar line is on the screen, not yet ended by a newline."""
        return self._drawn

    def finish(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise _BadInput(f"--option {item!r} is not KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options[key.strip()] = value
    return options


def _check_device(device: str | None) -> None:
    if device == "cuda":
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a dependency
            raise _BadInput(f"--device cuda: torch is not importable ({exc})") from exc
        if not torch.cuda.is_available():
            raise _BadInput("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")


def _placement_option(pipeline: Path, placement: str, device: str | None) -> str:
    """Check ``--placement`` (a file or inline JSON) and that the pipeline takes one; the pipeline validates it."""
    import inspect

    from pipelines.loader import PipelineLoadError, load_pipeline_module

    if device is not None:
        raise _BadInput("--device and --placement: give one (the placement names every stage's devices)")
    if not placement.strip().startswith("{"):  # else inline JSON, which the pipeline reads
        target = Path(placement)
        if target.exists() and not target.is_file():
            raise _BadInput(f"--placement: {placement!r} is not a regular file (a directory, a pipe or a device)")
        if not target.exists():
            try:
                given = json.loads(placement)
            except (ValueError, RecursionError):
                raise _BadInput(f"--placement: no such file {placement!r}") from None
            raise _BadInput(f"--placement: inline placement JSON must be an object, got {type(given).__name__}")
    try:
        factory = getattr(load_pipeline_module(pipeline), "get_service", None)
    except PipelineLoadError as exc:
        raise _BadInput(str(exc)) from exc
    if factory is None or "placement" not in inspect.signature(factory).parameters:
        raise _BadInput(f"--placement: pipeline {str(pipeline)!r} takes no placement (get_service has no 'placement')")
    return placement


def _fmt_seconds(value: Any) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _summary_lines(pipeline: str, metrics: Mapping[str, Any], out_dir: Path) -> list[str]:
    period = metrics.get("chunk_period", {})
    c2o = metrics.get("control_to_output_latency", {})
    controls = metrics.get("controls", {})
    rtf = metrics.get("real_time_factor")
    rows = [
        ("pipeline", f"{pipeline} ({metrics.get('kind')})"),
        (
            "output",
            f"{metrics.get('chunks')} chunks, {metrics.get('frames')} frames "
            f"{metrics.get('width')}x{metrics.get('height')} @ {metrics.get('fps')} fps, "
            f"{metrics.get('media_seconds', 0.0):.2f} s media"
            + (" (stream ended early)" if metrics.get("ended_early") else ""),
        ),
        ("wall time", _fmt_seconds(metrics.get("wall_seconds"))),
        ("first output", _fmt_seconds(metrics.get("first_output_latency_seconds"))),
        ("chunk period", f"p50 {_fmt_seconds(period.get('p50_seconds'))}, p95 {_fmt_seconds(period.get('p95_seconds'))}"),
        ("real-time factor", "-" if rtf is None else f"{rtf:.3f}"),
        (
            "control->output",
            f"p50 {_fmt_seconds(c2o.get('p50_seconds'))}, p95 {_fmt_seconds(c2o.get('p95_seconds'))} "
            f"({controls.get('pushed', 0)} pushed, {controls.get('rejected', 0)} rejected, "
            f"{controls.get('not_reached', 0)} not reached)",
        ),
        ("audio", "none" if not metrics.get("audio") else f"{metrics['audio']['sample_rate']} Hz AAC"),
    ]
    for stage, timing in metrics.get("stage_times", {}).items():
        rows.append((f"stage {stage}", f"mean {_fmt_seconds(timing.get('mean_seconds'))}"))
    rows += [("video", str(out_dir / "video.mp4")), ("metrics", str(out_dir / "metrics.json"))]
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}" for name, value in rows]


def _nothing_written(out: str) -> str:
    """What a stopped run says it left: nothing, and whether ``--out`` still holds an earlier run's output (it stays
    as it was; the folder looked like this run's success)."""
    from pipelines.offline import METRICS_NAME, VIDEO_NAME

    earlier = [name for name in (VIDEO_NAME, METRICS_NAME) if (Path(out) / name).is_file()]
    if not earlier:
        return "no output was written"
    return f"no output was written (the earlier {' and '.join(earlier)} in {out} are an earlier run's, unchanged)"


def _regular_file(flag: str, path: str) -> None:
    """A file the run reads must be a regular file: say which it is not (a FIFO or a directory was "no such file")."""
    target = Path(path)
    if not target.exists():
        raise _BadInput(f"{flag}: no such file {path!r}")
    if target.is_dir():
        raise _BadInput(f"{flag}: {path!r} is a directory, not a file")
    if not target.is_file():
        raise _BadInput(f"{flag}: {path!r} is not a regular file (a pipe, a socket or a device)")


def _cmd_run(args: argparse.Namespace) -> int:
    from pipelines.contract import SessionConfig, prompt_problem
    from pipelines.loader import PipelineLoadError, load_service
    from pipelines.offline import load_timed_controls, remove_partial_files, run_offline
    from server import json_limits
    from server.run_signals import trio_run_until_signalled

    if args.chunks < 1:
        raise _BadInput(f"--chunks must be >= 1, got {args.chunks}")
    pipeline = Path(args.pipeline)
    if not pipeline.exists():
        raise _BadInput(f"pipeline {args.pipeline!r} does not exist")
    if args.prompt is not None and (problem := prompt_problem(args.prompt)) is not None:
        raise _BadInput(f"--prompt {problem}")  # the rule a create and a room's prompt follow
    image_path = None
    if args.image is not None:
        _regular_file("--image", args.image)
        image_path = str(Path(args.image).resolve())
    controls = None
    if args.controls is not None:
        _regular_file("--controls", args.controls)
        try:
            controls = load_timed_controls(args.controls, loads=json_limits.loads)
        except ValueError as exc:
            raise _BadInput(str(exc)) from exc
    options = _parse_options(args.option)
    _check_device(args.device)
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise _BadInput(f"--out {args.out!r} exists and is not a directory")

    service_options: dict[str, Any] = {"gpu_num": 0}
    if args.device is not None:
        service_options["device"] = args.device
    if args.placement is not None:
        service_options["placement"] = _placement_option(pipeline, args.placement, args.device)
    if args.seed is not None:
        service_options["seed"] = args.seed
    try:
        service = load_service(pipeline, **service_options)
    except PipelineLoadError as exc:
        raise _BadInput(str(exc)) from exc
    if controls is not None and len(controls) and service.kind == "server_push":
        raise _BadInput(f"{args.pipeline!r} is a server-push pipeline; it takes no --controls")

    config = SessionConfig(prompt=args.prompt, image_path=image_path, options=options)
    created = not out_dir.exists()
    bar = ProgressBar(sys.stderr)

    def remove_empty_out_dir() -> None:
        if created:
            try:
                out_dir.rmdir()  # only if the failed run left it empty
            except OSError:
                pass

    def on_stop(number: int) -> None:
        bar.finish()
        print(f"chunkline run: {signal.Signals(number).name} received, stopping the run "
              f"(press Ctrl-C again to abort at once)", file=sys.stderr, flush=True)

    from engine.tensor_channel_refs import unlink_every_owned_segment

    nothing_written = _nothing_written(args.out)  # made now: the handler below may not do file system work

    def abort(first: int) -> NoReturn:  # in a signal handler: no buffered I/O, no waiting
        unlink_every_owned_segment()  # os._exit runs no finalizer: the stages' shared memory went nowhere
        remove_partial_files(out_dir)
        remove_empty_out_dir()
        line = f"chunkline run: aborted by a second signal; {nothing_written}\n".encode()
        os.write(2, b"\n" + line if bar.drawn else line)
        os._exit(128 + first)

    try:
        summary = trio_run_until_signalled(run_offline, service, config, controls, args.chunks, out_dir, bar,
                                           on_stop=on_stop, abort=abort)
    except BaseException:
        bar.finish()
        remove_empty_out_dir()
        raise
    bar.finish()
    for line in _summary_lines(args.pipeline, summary.metrics, out_dir):
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "stream-serve":
        return _cmd_stream_serve(args)
    if args.command == "worker":
        from server.cluster.worker_cli import cmd_worker

        return cmd_worker(args)
    if args.command == "run":
        from pipelines.contract import PipelineContractError
        from server.run_signals import StoppedBySignal

        try:
            return _cmd_run(args)
        except _BadInput as exc:
            print(f"chunkline run: {exc}", file=sys.stderr)
            return 2
        except PipelineContractError as exc:  # a pipeline bug (a bad chunk, session id...): not the user's input
            print(f"chunkline run: the run failed: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # the pipeline refused the request (e.g. an option)
            print(f"chunkline run: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C before the run had started
            print(f"chunkline run: interrupted; {_nothing_written(args.out)}", file=sys.stderr)
            return 130
        except StoppedBySignal as stopped:
            how = "terminated (SIGTERM)" if stopped.signal_number == signal.SIGTERM else "interrupted"
            print(f"chunkline run: {how}; {_nothing_written(args.out)}", file=sys.stderr)
            return 128 + stopped.signal_number
        except Exception as exc:
            print(f"chunkline run: the run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return 0  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())

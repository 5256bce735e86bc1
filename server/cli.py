"""The ``chunkline`` command line.

``chunkline run PIPE [--image FILE] [--prompt TEXT] [--controls FILE] [--chunks N] [--device cpu|cuda]
[--placement FILE|JSON] [--seed N] [--out DIR] [--option KEY=VALUE ...]`` runs a pipeline offline (see :mod:`pipelines.offline`):
it writes ``DIR/video.mp4`` and ``DIR/metrics.json``, draws a progress bar on stderr and prints a summary on
stdout. Bad input (a missing pipeline, image or controls file, a malformed controls file, an unknown control,
an unsupported device, options the pipeline refuses) is reported on stderr with exit code 2 and leaves no
output behind; a run that fails later exits 1, also without output files, and so does a pipeline that breaks
the contract (a chunk that is not a Chunk or not uint8, indexes that skip, a session id that is not a str) or does
not load for a reason of its own (its import or ``get_service()`` raises, ``get_service`` returns no service or
takes no ``gpu_num``; :func:`server.run_command.load_failure`): a pipeline bug, never bad input. A pipeline that calls
``sys.exit()`` while it is loaded or run is such a bug too (exit 1, the line naming the pipeline and its code): it
ended the run with that code, 0 read as a success. Every flag is checked before the pipeline loads
(:mod:`server.run_inputs`): ``--out`` is made then (a folder it made is taken back when the run fails), and a
``video.mp4``/``metrics.json`` already in it are replaced only by a run that succeeds. The first Ctrl-C (SIGINT),
SIGTERM, SIGHUP (its terminal closed) or SIGQUIT (Ctrl-\\) stops the run in order: the pipeline closes its session
and stages, no output is left, and the exit code is 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP) or 131 (SIGQUIT); a
stage that hangs can make that stop last as long as the pipeline's close deadline, so a second Ctrl-C or SIGTERM
aborts at once (no output is left; the exit code is the first signal's, 130 after Ctrl-C) without waiting for the
pipeline (:mod:`server.run_signals`). A stop signal before that, from the command's first line on (while it
imports what it needs), ends it the same way, in the same line, with no traceback (:mod:`server.early_signals`).

``--placement`` (both commands; ``CHUNKLINE_PLACEMENT`` for stream-serve) names a JSON placement file, or
is inline JSON starting with ``{``: where each stage runs (format: :mod:`pipelines.toy_world.placement`).
It is passed to ``get_service(placement=...)`` and only to pipelines whose ``get_service`` has a
``placement`` parameter. An impossible placement is refused naming the stage: by ``chunkline run`` before the run
(exit code 2); under ``stream-serve`` by the worker as it loads, which is then not restarted (health and the log say
``refused its configuration``) while the server serves on.

``chunkline stream-serve [PIPE] [--host H] [--port N] [--transport local|livekit] [--livekit-url URL] ...``
runs the stream server (:func:`server.serve.run`). Every setting of :class:`server.settings.ServerSettings` has
a ``--kebab-case`` flag and a ``CHUNKLINE_*`` environment variable (the table is in :mod:`server.settings`);
flags win over the environment, which wins over the defaults. ``PIPE`` may come from ``CHUNKLINE_PIPELINE``.
A bad value is reported as ``chunkline stream-serve: error: <message naming the option>`` with exit code 2.
SIGINT, SIGTERM and SIGHUP drain it (:mod:`server.serve`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from . import early_signals
from .console import tell

__all__ = ["build_parser", "main", "parse_stream_serve_args"]


def build_parser() -> Any:
    """The ``chunkline`` argument parser (:mod:`server.cli_parser`)."""
    from .cli_parser import build_parser as parser

    return parser()


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


def _cmd_stream_serve(args: Any) -> int:
    import importlib
    import os

    from server.setting_fields import require_existing_pipeline, require_usable_gpus
    from server.settings import ServerSettings, SettingsError

    prefix = "chunkline stream-serve"
    try:
        settings = ServerSettings.from_sources(vars(args), os.environ)
        require_existing_pipeline(settings.pipeline, None if args.pipeline else "CHUNKLINE_PIPELINE")
        require_usable_gpus(settings, None if args.worker_gpu_map is not None else "CHUNKLINE_WORKER_GPU_MAP")
    except SettingsError as exc:
        tell(f"{prefix}: error: {exc}")
        return 2
    for warning in ServerSettings.ignored_variables(os.environ):
        tell(f"{prefix}: warning: {warning}")
    serve = importlib.import_module("server.serve")  # lazily: `chunkline run` never loads the server stack
    early_signals.defer()  # from here its trio run takes the stop signals: one now is replayed to it
    try:
        result = serve.run(settings)
    except SettingsError as exc:  # a --host/--port (or cluster address) it cannot listen on
        tell(f"{prefix}: error: {exc}")
        return 2
    except KeyboardInterrupt:
        tell(f"{prefix}: interrupted")
        return 130
    return result if isinstance(result, int) else 0


#: the command's arguments, once parsed: what a stop signal before the command handles them tells with
_parsed: list[Any] = []


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    _parsed.append(args)
    if args.command == "stream-serve":
        return _cmd_stream_serve(args)
    if args.command == "worker":
        from server.cluster.worker_cli import cmd_worker

        return cmd_worker(args)
    if args.command == "run":
        from .run_command import run_command

        return run_command(args)
    return 0  # pragma: no cover - argparse rejects unknown commands


def main(argv: Sequence[str] | None = None) -> int:
    """The ``chunkline`` command. From its first line a stop signal ends it in one line with ``128 + signal``
    (130, 143, 129 for SIGHUP; 131 for SIGQUIT, a stop signal of ``chunkline run`` only), never a traceback, until a
    command handles them itself; once the command has returned, one changes nothing. As the process's own
    command (``argv`` None) its end waits for no thread the pipeline left running (:mod:`server.stray_threads`)."""
    if _command_word(argv) == "run":  # it stops on SIGQUIT too (Ctrl-\: its default dumped core, leaving its files)
        early_signals.stop_also(*early_signals.RUN_STOP_SIGNALS)
        if argv is None:  # the process's own: what the pipeline leaves behind a shell is found at the end
            from .stray_threads import adopt_orphans

            adopt_orphans()
    early_signals.install()
    ending = False  # the command returned as the process's own: its end keeps noting the stop signals
    try:
        code = _main(argv)
        ending = argv is None
    except early_signals.StopSignalled as stopped:
        tell(_stopped_line(stopped.signal_number, argv))  # a closed terminal: the code says it
        return 128 + stopped.signal_number
    finally:
        if not ending:
            early_signals.hand_over()
    if argv is not None:  # called with its words (a test, a script): the caller's process is not ours to end
        return code
    # the command is over and its status decided: a stop signal from here to the exit (the wait for a pipeline's
    # threads, the last flushes) is noted and changes nothing; with Python's defaults back it ended the process by
    # the signal, or with a KeyboardInterrupt traceback, after the run had said it succeeded
    early_signals.defer()
    from .stray_threads import end_despite_stray_threads  # a pipeline's threads left running hold no exit

    return end_despite_stray_threads(_prefix(), code)


def _stopped_line(number: int, argv: Sequence[str] | None) -> str:
    """What a stop signal before the command handled them says: under ``chunkline run`` the line its run says
    (``chunkline run: interrupted; no output was written``: in its first half second, as it imported what it runs, it
    said ``chunkline: interrupted``, naming nothing it stopped), else ``chunkline: interrupted``."""
    args = _parsed[-1] if _parsed else None
    if (args.command if args is not None else _command_word(argv)) != "run":
        return f"chunkline: {early_signals.describe(number)}"
    # the stop signals are ignored from the first one on (early_signals): nothing breaks this import off, even where
    # the signal came as it was imported
    from .run_command import PREFIX, stopped_line

    return f"{PREFIX}: {stopped_line(number, None if args is None else args.out)}"


def _command_word(argv: Sequence[str] | None) -> str | None:
    """The command the words name before they are parsed (their first that is no flag): ``run``..."""
    return next((word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")), None)


def _prefix() -> str:
    """``chunkline <command>``, as the command's own lines begin."""
    command = next((word for word in sys.argv[1:] if word in {"run", "stream-serve", "worker"}), None)
    return "chunkline" if command is None else f"chunkline {command}"


if __name__ == "__main__":
    sys.exit(main())

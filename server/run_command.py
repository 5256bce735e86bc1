"""``chunkline run PIPE ...``: one session of a pipeline offline (:mod:`pipelines.offline`), as :mod:`server.cli`
describes it; the flags are checked first (:mod:`server.run_inputs`), the stop signals handled by
:mod:`server.run_signals`."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from pipelines.error_text import error_line, one_line

from . import early_signals
from .console import is_broken_pipe, tell
from .early_signals import StopSignalled, describe, stop_signals
from .run_inputs import BadInput, shown

if TYPE_CHECKING:
    from pipelines.offline import RunDeadlines

__all__ = ["CLOSE_TIMEOUT", "PipelineDidNotLoad", "ProgressBar", "load_failure", "run_command", "run_deadlines",
           "stopped_line"]

PREFIX = "chunkline run"
#: seconds a run's close (``close_session``, a stream's ``aclose``) may take before it is cut: the run is done by
#: then and its output about to be written, so less than the server's ``CLOSE_PIPELINE_TIMEOUT`` (30 s), which
#: keeps a worker's slot for the next session
CLOSE_TIMEOUT = 10.0


def run_deadlines() -> RunDeadlines:
    """The server's deadlines for the same calls (a :class:`pipelines.offline.RunDeadlines`): entering
    ``running()`` as a process worker's proxy waits for it, ``create_session``, ``push_control`` and a stream's
    chunks as a room's runner does (``CHUNK_STALL_TIMEOUT``, :mod:`server.pushed_stream`). One source: the run
    meets the limits the pipeline meets when served."""
    from pipelines.offline import RunDeadlines

    from .process_service.deadlines import CallDeadlines
    from .runner import CHUNK_STALL_TIMEOUT, CONTROL_TIMEOUT, CREATE_PIPELINE_TIMEOUT

    return RunDeadlines(running=CallDeadlines().running, create_session=CREATE_PIPELINE_TIMEOUT,
                        push_control=CONTROL_TIMEOUT, chunk=CHUNK_STALL_TIMEOUT, close=CLOSE_TIMEOUT)


def say(line: str) -> None:
    """One line on stderr, never an error: a closed terminal (SIGHUP) fails every write with EIO, and the
    exit code must still say how the run ended (:func:`server.console.tell`). A pipeline's message of several lines
    is joined into it (its lines after the first read as lines of their own, with no ``chunkline run:``)."""
    tell(f"{PREFIX}: {one_line(line)}")


class ProgressBar:
    """A ``\\r``-updated text progress bar on a terminal: ``[#######.......]  3/8 chunks  1.2 s``; elsewhere (a log
    file, a pipe) a plain line for chunks 1-10, 20, 30... 100, 200...: a bar redrawn per chunk filled logs with
    frames. A write that fails (the terminal is gone) fails nothing else, and a stream closed when the command
    started (``None``: ``2>&-``) is written nothing."""

    def __init__(self, stream: TextIO | None, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._drawn = False
        self._started = time.perf_counter()
        self._terminal = False
        if stream is not None:
            try:
                self._terminal = stream.isatty()
            except (OSError, ValueError):
                pass

    def _write(self, text: str) -> None:
        if self._stream is None:
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self._started
        count = f"{done:>{len(str(total))}}/{total} chunks  {elapsed:6.1f} s"
        if not self._terminal:
            # 1-10, then every 10 up to 100, every 100 up to 1,000...: some ten lines a tenfold, and the last
            if done == total or done % 10 ** max(0, len(str(done)) - 1) == 0:
                self._write(count + "\n")
            return
        filled = min(self._width, round(self._width * done / total)) if total else self._width
        bar = "#" * filled + "." * (self._width - filled)
        self._write(f"\r[{bar}] {count}")
        self._drawn = True

    def end_line(self) -> bool:
        """Whether a bar line is on the screen, taken as ended by a line written after it (by ``os.write``)."""
        drawn, self._drawn = self._drawn, False
        return drawn

    @property
    def drawn(self) -> bool:
        """A bar line is on the screen, not yet ended by a newline."""
        return self._drawn

    def finish(self) -> None:
        if self._drawn:
            self._write("\n")
            self._drawn = False


def _count(number: object, noun: str) -> str:
    """``1 chunk``, ``8 chunks``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


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
            f"{_count(metrics.get('chunks'), 'chunk')}, {_count(metrics.get('frames'), 'frame')} "
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

    earlier = [name for name in (VIDEO_NAME, METRICS_NAME) if out and (Path(out) / name).is_file()]
    if not earlier:
        return "no output was written"
    return f"no output was written (the earlier {' and '.join(earlier)} in {out} are an earlier run's, unchanged)"


#: the stop signal whose stop has ended and been said (``interrupted; no output was written``): a second signal on
#: the command's way out (it waits up to 3 s for threads its pipeline left running) ends it at once, saying nothing
_stop_told: list[int] = []


def _tell_stopped(number: int, out: str, met: tuple[str, ...] = ()) -> int:
    """Say that a stop signal stopped the run, and mark it said (:data:`_stop_told`); the exit code. A stop signal
    while it is said is noted, and comes once it is marked (a second one ends the command then, after the line and
    without a line of its own: it said `aborted by a second signal` of a stop that had ended). The handlers are
    swapped, not the signals blocked: any thread of the process may take a signal, and the main one runs its
    handler."""
    noted: list[int] = []
    previous = {each: signal.signal(each, lambda noting, _frame: noted.append(noting)) for each in stop_signals()}
    try:
        say(stopped_line(number, out, met))
        _stop_told.append(number)
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)
    for each in noted:
        signal.raise_signal(each)
    return 128 + number


def stopped_line(number: int, out: str | None, met: tuple[str, ...] = ()) -> str:
    """What a run a stop signal ended says (after ``chunkline run: ``): ``interrupted; no output was written``, the
    same line from the command's first line on (``out``: ``--out`` as given, None before it was read): one in its
    first half second, as it imported what it runs, said only ``chunkline: interrupted``. ``met``: what the stop
    met (``interrupted, and the stop met: pipeline bug: close_session did not return within 10 s; ...``: a close cut
    at its deadline was not said)."""
    try:
        folder = str(Path(out).absolute()) if out else ""
    except OSError:  # the working directory is gone
        folder = out or ""
    return f"{_stop_words(number, met)}; {_nothing_written(folder)}"


def _stop_words(number: int, met: Sequence[str] = ()) -> str:
    """How a stop signal ended the run, and what the stop met (``interrupted, and the stop met: ...``)."""
    return f"{describe(number)}, and the stop met: {'; '.join(met)}" if met else describe(number)


class _PipelineExitedDuringRun(Exception):
    """The pipeline called ``sys.exit()`` during the run (a pipeline bug: exit code 1)."""


class PipelineDidNotLoad(Exception):
    """The pipeline failed to load for a reason that is not in the user's arguments (exit code 1, ``the run failed:
    ...``): its bug (``pipeline bug: ...``), a module its import needs, a refusal of ``gpu_num=0`` alone."""


#: the flags whose values reach ``get_service``, by the option each is given as
SERVICE_FLAGS = {"device": "--device", "seed": "--seed", "placement": "--placement"}


def load_failure(exc: Exception, given: Mapping[str, Any]) -> Exception:
    """What a failed load (a :class:`pipelines.loader.PipelineLoadError`; ``given``: the options ``get_service`` was
    to be called with) is under ``chunkline run``. The user's bad input, exit 2 (:class:`BadInput`): no pipeline at
    that path, a flag's option that ``get_service`` does not take or refuses (``ValueError``), the flag named. The
    pipeline's failure, exit 1 (:class:`PipelineDidNotLoad`): its bug, as the server counts it (a worker that
    failed, not one that refused its settings): its import or ``get_service()`` raised, or returned no service, a
    method of the wrong kind, no ``gpu_num``; a module its import needs; a ``ValueError`` with no flag's option
    given, which refuses the ``gpu_num=0`` every run gives. They all exited 2, a ``KeyError`` in ``get_service``
    too, while the same ``KeyError`` in ``create_session`` exits 1 as ``pipeline bug: ...``."""
    from pipelines.loader import OptionsNotAccepted, OptionValuesRefused, PipelineBug, PipelineExited, PipelineFailedToLoad

    if isinstance(exc, PipelineExited):
        return exc  # said as such: `pipeline 'p.py' called sys.exit(0) ...`
    if isinstance(exc, PipelineBug):
        return PipelineDidNotLoad(f"pipeline bug: {exc}")
    if isinstance(exc, PipelineFailedToLoad):
        return PipelineDidNotLoad(str(exc))
    flags = [flag for name, flag in SERVICE_FLAGS.items() if name in given]
    if isinstance(exc, OptionValuesRefused):
        if not flags:
            return PipelineDidNotLoad(f"{exc} (given gpu_num=0 alone, which every chunkline run gives)")
        return BadInput(f"{', '.join(flags)}: {exc}")
    if isinstance(exc, OptionsNotAccepted):
        named = [SERVICE_FLAGS[name] for name in exc.names if name in SERVICE_FLAGS]
        return BadInput(f"{', '.join(named)}: {exc}" if named else str(exc))
    return BadInput(str(exc))  # no pipeline there


def _run(args: argparse.Namespace) -> int:
    from pipelines.contract import SessionConfig, prompt_problem

    from . import run_inputs

    run_inputs.check_chunks(args.chunks)
    pipeline = run_inputs.pipeline_path(args.pipeline)
    if args.prompt is not None and (problem := prompt_problem(args.prompt)) is not None:
        raise BadInput(f"--prompt {problem}")  # the rule a create and a room's prompt follow
    image_path = None if args.image is None else run_inputs.check_image(args.image)
    controls = None if args.controls is None else run_inputs.load_controls(args.controls)
    options = run_inputs.parse_options(args.option)
    run_inputs.check_device(args.device)
    if args.placement is not None:
        run_inputs.check_placement(args.placement, args.device)
    out = run_inputs.prepare_out(args.out)  # the last check: it makes the folder, taken back on any failure
    streams = KeptStreams()  # before the pipeline loads
    try:
        return _load_and_run(args, pipeline, SessionConfig(prompt=args.prompt, image_path=image_path, options=options),
                             controls, out, streams)
    except BaseException:
        out.remove_made()
        raise
    finally:
        streams.put_back()  # for the line that says how the run ended
        out.release()  # its outputs are in place, or none will be: another run may have the folder


class KeptStreams:
    """``sys.stdout`` and ``sys.stderr`` as the command began. A pipeline that replaced one (``sys.stdout = None``, a
    buffer of its own) had the run's summary, or the line saying how it ended, go nowhere: they are put back, and
    that said once."""

    def __init__(self) -> None:
        self._kept = (sys.stdout, sys.stderr)

    def put_back(self) -> None:
        replaced = [f"sys.{name}" for name, kept in zip(("stdout", "stderr"), self._kept)
                    if getattr(sys, name) is not kept]
        sys.stdout, sys.stderr = self._kept
        if replaced:
            say(f"warning: pipeline bug: the pipeline replaced {' and '.join(replaced)}; the run put "
                f"{'it' if len(replaced) == 1 else 'them'} back for its own lines")


def _load_and_run(args: argparse.Namespace, pipeline: Path, config: Any, controls: Any, out: Any,
                  streams: KeptStreams) -> int:
    from pipelines.loader import PipelineLoadError, load_service, pipeline_folder, where
    from pipelines.loop_watch import probe
    from pipelines.offline import remove_partial_files, remove_stale_partial_files, run_offline

    from . import run_inputs
    from .run_signals import StoppedBySignal, trio_run_until_signalled

    service_options: dict[str, Any] = {"gpu_num": 0}
    try:
        if args.device is not None:
            service_options["device"] = args.device
        if args.placement is not None:
            service_options["placement"] = run_inputs.placement_option(pipeline, args.placement)
        if args.seed is not None:
            service_options["seed"] = args.seed
        service = load_service(pipeline, **service_options)
    except PipelineLoadError as exc:
        raise load_failure(exc, service_options) from exc
    except (KeyboardInterrupt, SystemExit, StopSignalled, BadInput):  # BadInput: a --placement it takes not: exit 2
        raise
    except BaseException as exc:  # the pipeline's own (class Abort(BaseException)), past the loader's `except Exception`
        raise PipelineDidNotLoad(f"pipeline bug: loading {shown(args.pipeline)} raised {error_line(exc)}") from exc
    if controls is not None and len(controls) and service.kind == "server_push":
        raise BadInput(f"{shown(args.pipeline)} is a server-push pipeline; it takes no --controls")
    run_inputs.check_inputs_taken(service, pipeline=args.pipeline, prompt=args.prompt, image=args.image)

    if stale := remove_stale_partial_files(out.path):  # a run killed outright left them; nothing else would
        say(f"removed {len(stale)} temporary file(s) that runs killed before they finished left in {out.path}")
    bar = ProgressBar(sys.stderr)
    stopped_by: list[int] = []  # the first stop signal, once it came

    def on_stop(number: int) -> None:  # in a signal handler: no buffered I/O
        stopped_by.append(number)
        probe()  # a stop in order needs trio's thread: one the pipeline holds is said, and the run ends, within 2 s
        line = (f"{PREFIX}: {signal.Signals(number).name} received, stopping the run (press Ctrl-C again to abort at "
                f"once)\n").encode()
        try:
            os.write(2, b"\n" + line if bar.end_line() else line)
        except OSError:  # a closed terminal (SIGHUP): the exit code says it
            pass

    from engine.supervised_child import end_descendants_now
    from engine.tensor_channel_refs import unlink_every_owned_segment

    nothing_written = _nothing_written(str(out.path))  # made now: the handler below may not do file system work

    def end_at_once(code: int, line: str | None) -> NoReturn:  # in a signal handler or a watchdog: no buffered I/O
        end_descendants_now()  # its stage processes, and the shared memory they made
        unlink_every_owned_segment()  # os._exit runs no finalizer: the stages' shared memory went nowhere
        remove_partial_files(out.path)
        out.remove_made()
        if line is not None:
            said = f"{PREFIX}: {one_line(line)}\n".encode()
            try:
                os.write(2, b"\n" + said if bar.drawn else said)
            except OSError:
                pass
        os._exit(code)

    def on_taken(number: int) -> None:  # in trio, between the bar's lines
        line = (f"{PREFIX}: warning: pipeline bug: the pipeline replaced the run's {signal.Signals(number).name} "
                f"handler; the run put its own back (a stop signal stops the run in order)")
        tell(f"\n{line}" if bar.end_line() else line)

    def abort(first: int) -> NoReturn:  # in a signal handler: no waiting
        if _stop_told:  # the stop had ended and said so: nothing is aborted, the command only ends now, its status
            end_at_once(128 + first, None)  # the first signal's (it said `aborted by a second signal` as well)
        end_at_once(128 + first, f"aborted by a second signal; {nothing_written}")

    def blocked(line: str) -> NoReturn:  # in the watchdog's thread: trio's, the main one, is held by the pipeline
        if stopped_by:  # the user asked it to stop: the status says so, whatever the stop then met (exit 1 before)
            end_at_once(128 + stopped_by[0], f"{_stop_words(stopped_by[0], [line])}; {nothing_written}")
        end_at_once(1, f"the run failed: {line}")

    early_signals.defer()  # a signal as the trio run starts is noted, and replayed once its handlers are in
    try:
        from .chunk_publisher import checked_metadata  # a served session's rule for what a chunk carries

        met: list[str] = []  # what the run warned of as it went (a close cut at its deadline): a stop says it too
        run = functools.partial(run_offline, deadlines=run_deadlines(), chunk_check=checked_metadata,
                                on_blocked=blocked, warned=met)
        try:
            summary = trio_run_until_signalled(run, service, config, controls, args.chunks, out.path, bar,
                                               on_stop=on_stop, abort=abort, on_taken=on_taken)
        except StoppedBySignal as stopped:
            stopped.met = tuple(met)
            raise
    except SystemExit as exc:  # the pipeline's own: it ended the run with a code (0 read as a success)
        raise _PipelineExitedDuringRun(f"pipeline {str(args.pipeline)!r} called sys.exit({exc.code!r}) during the "
                                       f"run{where(exc, pipeline_folder(args.pipeline))}") from None
    finally:
        bar.finish()
        streams.put_back()  # for the summary
        early_signals.install()  # where the run's handlers are gone again (not where a signal stopped it)
        early_signals.replay()  # one noted that the run never took
    try:  # flushed: a pipe's EPIPE comes here, not at the interpreter's exit
        unwritten = tell("\n".join(_summary_lines(args.pipeline, summary.metrics, out.path)), to="stdout")
    except StopSignalled as stopped:  # the output is there: the run is not undone by a late signal
        say(f"{describe(stopped.signal_number)} after the run; its output is in {out.path}")
        return 128 + stopped.signal_number
    # a stdout that takes no summary (closed, a full disk) does not undo the written run; a reader that left (`| head
    # -1`) wants no word of it
    if unwritten is not None and not is_broken_pipe(unwritten):
        say(f"warning: the summary could not be written to stdout ({unwritten}); the output is in {out.path}")
    for warning in summary.warnings:  # the output is complete: a script reading the exit code keeps it
        say(f"warning: {warning}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    """Run it; every way it ends is one line on stderr and an exit code (0 done, 1 the run or the pipeline failed,
    2 bad input, 128 + the signal that stopped it)."""
    from pipelines.contract import PipelineContractError
    from pipelines.loader import PipelineExited
    from pipelines.offline import ChunkFailed
    from pipelines.offline_calls import ServiceFailed, single_leaf

    from .run_signals import StoppedBySignal, stop_signal_came

    try:  # now: the pipeline may change the working directory
        out = str(Path(args.out).absolute()) if args.out else ""
    except OSError:  # the working directory is gone: --out is refused, naming it
        out = args.out
    try:
        return _run(args)
    except BadInput as exc:
        say(str(exc))
        return 2
    except (PipelineContractError, PipelineExited, _PipelineExitedDuringRun, PipelineDidNotLoad,
            ChunkFailed, ServiceFailed) as exc:  # not input
        say(f"the run failed: {exc}")
        return 1
    except ValueError as exc:  # the pipeline refused the request (e.g. an option)
        say(str(exc))
        return 2
    except KeyboardInterrupt as exc:  # a Ctrl-C is a StopSignalled before the run, a StoppedBySignal in it
        if not stop_signal_came():  # raised by the pipeline itself: 130 told the user they had interrupted it
            say(f"the run failed: pipeline bug: {error_line(exc)} raised by the pipeline, though no Ctrl-C or other "
                f"stop signal came")
            return 1
        return _tell_stopped(signal.SIGINT, out)
    except (StopSignalled, StoppedBySignal) as stopped:
        return _tell_stopped(stopped.signal_number, out, getattr(stopped, "met", ()))
    except Exception as exc:
        say(f"the run failed: {error_line(exc)}")
        return 1
    except BaseException as exc:  # the pipeline's own that no call named (a GeneratorExit it raised): not a traceback
        if isinstance(exc, SystemExit):
            raise
        say(f"the run failed: pipeline bug: the pipeline raised {error_line(single_leaf(exc))}")
        return 1

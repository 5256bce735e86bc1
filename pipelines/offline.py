"""Offline runs: drive a service without a server, write ``video.mp4`` and ``metrics.json``.

This is what ``chunkline run PIPE`` uses. :func:`run_offline` enters ``service.running()`` itself.

The timed controls file format is documented in :mod:`pipelines.timed_controls`.

The media clock: chunk ``k`` starts at the media time of the frames before it (``k * frames_per_chunk / fps``
for a steady stream). A control at ``t`` applies to the first chunk whose start time is ``>= t``: the runner
pushes it after receiving the chunk before that one and before requesting that chunk. Entries with the same
``t`` are pushed in file order; entries after the last chunk's start are never pushed (``not_reached``).

Deadlines
---------

Every call of the pipeline's that the run waits for has a deadline (:class:`RunDeadlines`; ``chunkline run``
gives the server's own, :mod:`server.run_command`): entering ``running()``, ``create_session``, a server-push
``stream()``'s first chunk, ``push_control``. Past one the run fails as the pipeline's bug
(:class:`PipelineCallError`, ``pipeline bug: create_session did not return within 60 s``), and so does one of those
calls that raises other than ``ValueError`` (a refusal of the request), naming the call. Every later chunk of a
server-push stream, and every chunk of a bidirectional session's ``chunks()``, has the server's stall deadline for a
server-push stream (``deadlines.chunk``, 60 s): the run asks for each chunk it waits for, so one that does not come
is a stalled pipeline (``pipeline bug: stream() stalled: chunk 1 did not come within 60 s``; it held the run for
ever). Closing (``close_session``, a stream's ``aclose``) is bounded too, but its run is done: one that hangs is cut
at its deadline and a run whose chunks all came still succeeds, the cut said in :attr:`OfflineRunSummary.warnings`.

The outputs and what ``metrics.json`` holds are described in :mod:`pipelines.offline_metrics`.

Both files are written under temporary hidden names in ``out_dir`` and renamed into place only when the run
is complete, so an interrupted or failed run leaves no file that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .chunk_wait import ChunkLate, next_chunk_within
from .contract import (
    BidirectionalService,
    Chunk,
    ChunkOrder,
    ControlRejected,
    PipelineContractError,
    ServerPushService,
    SessionConfig,
    checked_session_id,
    checked_stream,
)
from .error_text import error_line
from .images import ImageRefused, check_image_file
from .loop_watch import LoopWatchdog, waiting
from .mp4 import Mp4Writer, StreamChanged
from .offline_calls import (
    PipelineCallError,
    RunDeadlines,
    call_within,
    close_within,
    raised_as_error,
    running_within,
    telling_error,
)
from .offline_metrics import CLOCK_TOLERANCE, METRICS_NAME, VIDEO_NAME, Recorder, metrics_text
from .timed_controls import (
    KEY_ALIASES,
    TimedControl,
    TimedControls,
    load_timed_controls,
    normalize_key,
    parse_timed_controls,
)

__all__ = [
    "ChunkFailed",
    "KEY_ALIASES",
    "METRICS_NAME",
    "OfflineRunSummary",
    "PipelineCallError",
    "RunDeadlines",
    "TimedControl",
    "TimedControls",
    "VIDEO_NAME",
    "load_timed_controls",
    "normalize_key",
    "output_problem",
    "parse_timed_controls",
    "remove_partial_files",
    "remove_stale_partial_files",
    "run_offline",
]

def output_problem(out_dir: str | os.PathLike[str]) -> str | None:
    """Why a run could not put its output in ``out_dir``, or None: a directory (not a link) where ``video.mp4`` or
    ``metrics.json`` goes cannot be replaced by a file. Found only as the run ended, after the whole run, and once
    the video had replaced the one there when ``metrics.json`` was the directory."""
    for name in (VIDEO_NAME, METRICS_NAME):
        path = Path(out_dir) / name
        if path.is_dir() and not path.is_symlink():
            return f"{str(path)!r} is a directory, which the run's {name} cannot replace"
    return None


#: the session options a run sets itself on a service that applies the timeline (``supports_timeline``):
#: chunks back to back, and as many as the run asks for; a caller's own value would be overwritten unseen
RUN_OPTIONS = ("chunks", "continuous")


@attrs.frozen
class OfflineRunSummary:
    """What :func:`run_offline` did; ``metrics`` is what ``metrics.json`` holds."""

    kind: str
    chunks: int
    frames: int
    media_seconds: float
    wall_seconds: float
    video_path: Path
    metrics_path: Path
    metrics: Mapping[str, Any]
    #: what went wrong without failing the run, one line each (a close cut at its deadline)
    warnings: tuple[str, ...] = ()


class ChunkFailed(RuntimeError):
    """The pipeline raised while making a chunk; the message names the chunk and the error (anything but a
    ValueError read only ``the run failed: KeyError: 'k'``, naming neither)."""


# --- the runner ---------------------------------------------------------------------------------------------


@attrs.define
class _Run:
    recorder: Recorder
    send: trio.MemorySendChannel[Chunk]
    total: int
    progress: Callable[[int, int], None] | None
    deadlines: RunDeadlines
    chunk_check: Callable[[Chunk], Chunk] | None = None
    order: ChunkOrder = attrs.Factory(ChunkOrder)
    warnings: list[str] = attrs.Factory(list)

    async def next_chunk(self, iterator: Any, call: str, *, setup: bool = False) -> Chunk | None:
        """The stream's next chunk, checked (None: the stream ended), within ``deadlines.chunk``, or, for a
        server-push stream's first chunk (``setup``: its session's setup), ``deadlines.create_session``; past it a
        :class:`PipelineCallError` naming ``call``. Whatever goes wrong while the pipeline makes it is the
        pipeline's failure, never the request's (a ValueError too): a :class:`ChunkFailed` naming the chunk, or for
        the setup's chunk a :class:`PipelineCallError`, as a create that raised."""
        index = self.order.next_index
        seconds = self.deadlines.create_session if setup else self.deadlines.chunk
        try:
            with waiting(call, seconds, late=f"{call} did not give chunk {index} within {seconds:g} s"):
                chunk = await next_chunk_within(iterator, self.order, seconds)
            return chunk if chunk is None or self.chunk_check is None else self.chunk_check(chunk)
        except ChunkLate as late:
            if setup:
                raise PipelineCallError(call, f"gave no first chunk within {seconds:g} s") from None
            raise PipelineCallError(call, f"stalled: {late}") from None
        except PipelineContractError:
            raise
        except BaseException as exc:
            if not raised_as_error(exc):
                raise
            if setup:  # its session's setup, as create_session's (it read only "the pipeline failed making chunk 0")
                raise PipelineCallError.raised(call, exc, then=" before its first chunk") from exc
            raise ChunkFailed(f"the pipeline failed making chunk {index}: {error_line(exc)}") from exc

    async def close(self, call: str, function: Callable[[], Any]) -> None:
        """A bounded close; one cut at its deadline is a warning, the run's output kept."""
        warning = await close_within(call, self.deadlines.close, function)
        if warning is not None:
            self.warnings.append(warning)

    async def deliver(self, chunk: Chunk) -> None:
        self.recorder.chunk(chunk, time.perf_counter())
        await self.send.send(chunk)
        if self.progress is not None:
            self.progress(len(self.recorder.arrivals), self.total)


async def _close_stream(name: str, iterator: Any, run: _Run) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await run.close(f"closing the {name} stream", aclose)


async def _run_bidirectional(
    service: BidirectionalService, config: SessionConfig, controls: Sequence[TimedControl], run: _Run
) -> None:
    rec = run.recorder
    given = config.options  # the user's own (--option): a scripted service's config gets the run's added
    scripted = service.supports_timeline
    scripted_controls: Sequence[TimedControl] = controls if scripted else ()
    if scripted:
        # the service applies the controls itself on the media clock, deterministically,
        # however far ahead it computes; it reports each chunk's control-to-output latency
        config = attrs.evolve(
            config,
            timeline=tuple((timed.t, timed.control) for timed in controls),
            options={**config.options, "continuous": True, "chunks": run.total},
        )
        controls = ()
    deadlines = run.deadlines
    async with running_within(service, deadlines.running, leave=(deadlines.close, run.warnings.append)):
        await _check_given_inputs(service, given, config.image_path, run)
        rec.session_requested = time.perf_counter()
        try:
            session_id = await call_within("create_session", deadlines.create_session,
                                           lambda: service.create_session(config, on_event=rec.event))
        except ValueError as exc:  # the request refused: said as such (it read only the pipeline's words)
            raise ValueError(f"the pipeline refused the session: {exc}") from None
        rec.session_id = checked_session_id(session_id)
        rec.expect_scripted(scripted_controls)
        rec.session_setup = time.perf_counter() - rec.session_requested
        iterator = None
        try:
            iterator = checked_stream(service.chunks(checked_session_id(session_id)), "chunks()")
            position = 0
            start = 0.0  # media time at which the next chunk starts
            for index in range(run.total):
                while position < len(controls) and controls[position].t <= start + CLOCK_TOLERANCE:
                    timed = controls[position]
                    position += 1
                    pushed_at = time.perf_counter()
                    try:
                        await call_within("push_control", deadlines.push_control,
                                          lambda: service.push_control(session_id, timed.control),
                                          refusal=ControlRejected)
                    except ControlRejected as exc:
                        rec.rejected(timed, index, exc.reason)
                        continue
                    rec.pushed(timed, index, pushed_at)
                chunk = await run.next_chunk(iterator, "chunks()")
                if chunk is None:
                    rec.ended_early = True
                    return
                await run.deliver(chunk)
                start += chunk.media_seconds
        finally:
            if iterator is not None:
                await _close_stream("chunks()", iterator, run)
            await run.close("close_session", lambda: service.close_session(session_id))


async def _check_given_inputs(service: BidirectionalService | ServerPushService, options: Mapping[str, Any],
                              image_path: str | None, run: _Run) -> None:
    """The options and image the user gave, checked as the server checks a create's (``check_options``, the very check
    the session's start runs, and ``check_image`` of the image's size): a refusal names the flag (``--option: toy
    world: unknown option(s) ...``; it named none). The image's check was never asked: a run took what the server
    refuses (``invalid_image``)."""
    if options:
        try:
            await call_within("check_options", run.deadlines.create_session,
                              lambda: service.check_options(dict(options)))
        except ValueError as exc:
            raise ValueError(f"--option: {exc}") from None
    if image_path is not None:
        try:
            image = await trio.to_thread.run_sync(check_image_file, image_path)  # its header: the server's rule too
            await call_within("check_image", run.deadlines.create_session,
                              lambda: service.check_image(image.width, image.height))
        except ImageRefused as exc:
            raise ValueError(f"--image: {exc.detail}") from None
        except ValueError as exc:
            raise ValueError(f"--image: {exc}") from None


async def _run_server_push(service: ServerPushService, config: SessionConfig, run: _Run) -> None:
    rec = run.recorder
    async with running_within(service, run.deadlines.running, leave=(run.deadlines.close, run.warnings.append)):
        await _check_given_inputs(service, config.options, config.image_path, run)
        rec.session_requested = time.perf_counter()
        iterator = checked_stream(service.stream(config), "stream()")
        rec.session_setup = time.perf_counter() - rec.session_requested
        try:
            for index in range(run.total):
                chunk = await run.next_chunk(iterator, "stream()", setup=index == 0)
                if chunk is None:
                    rec.ended_early = True
                    return
                await run.deliver(chunk)
        finally:
            await _close_stream("stream()", iterator, run)


async def _write_chunks(writer: Mp4Writer, receive: trio.MemoryReceiveChannel[Chunk]) -> None:
    # A failure here is the run's (inconsistent chunks, an encoder error), never the request's, so it is a
    # RuntimeError even where PyAV raises one of its ValueError subclasses.
    try:
        async with receive:
            async for chunk in receive:
                await trio.to_thread.run_sync(writer.write, chunk)
        await trio.to_thread.run_sync(writer.finish)
    except RuntimeError:
        raise
    except StreamChanged as exc:  # the run's one video, not the encoder (it read "writing video.mp4 failed: ValueError")
        raise ChunkFailed(f"{exc}; a run's {VIDEO_NAME} keeps the first chunk's fps, frame size and audio format") from None
    except Exception as exc:
        raise RuntimeError(f"writing {VIDEO_NAME} failed: {type(exc).__name__}: {exc}") from exc


def _temp_path(out_dir: Path, name: str) -> Path:
    """A hidden name that no other run uses; the file itself is created by its writer (umask applies)."""
    return out_dir / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.partial"


def remove_partial_files(out_dir: str | os.PathLike[str]) -> None:
    """Remove this process's temporary files in ``out_dir``: for an abort that cannot wait for the run to
    clean up after itself (other runs' temporaries, named with their own pids, are left alone)."""
    for path in _partial_files(out_dir, str(os.getpid())):
        path.unlink(missing_ok=True)


def remove_stale_partial_files(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files in ``out_dir`` of runs whose process is gone (killed outright: SIGKILL, a host that
    ran out of memory, a power cut), which nothing else ever removed; returns them. Those of a process still there, or
    of another user's, are left alone: it may be writing them."""
    removed = []
    for path in _partial_files(out_dir, "*"):
        pid = path.name.rsplit(".", 3)[1]  # .{name}.{pid}.{hex}.partial (_temp_path)
        if not pid.isdigit() or _process_runs(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _partial_files(out_dir: str | os.PathLike[str], pid: str) -> list[Path]:
    """The temporary files in ``out_dir`` of the run of process ``pid`` (``*``: of every run)."""
    return [path for name in (VIDEO_NAME, METRICS_NAME) for path in Path(out_dir).glob(f".{name}.{pid}.*.partial")]


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


async def run_offline(
    service: BidirectionalService | ServerPushService,
    config: SessionConfig,
    controls: TimedControls | None,
    chunks: int,
    out_dir: str | os.PathLike[str],
    progress: Callable[[int, int], None] | None = None,
    *,
    deadlines: RunDeadlines,
    chunk_check: Callable[[Chunk], Chunk] | None = None,
    on_blocked: Callable[[str], object] | None = None,
    warned: list[str] | None = None,
) -> OfflineRunSummary:
    """Run one session of ``service`` for up to ``chunks`` chunks; write ``video.mp4`` and ``metrics.json``.

    A bidirectional service gets one session with ``controls`` pushed on the media clock; a server-push
    service streams ``config`` (it takes no controls: passing any raises ``ValueError``). ``progress(done,
    total)`` is called after each chunk. A service that applies the timeline itself gets the options
    :data:`RUN_OPTIONS` from the run; a ``config`` that sets one of them is a ``ValueError`` (it would be
    overwritten). ``deadlines`` bound the pipeline's calls (:class:`RunDeadlines`; past one, or when one raises,
    a :class:`PipelineCallError`). ``chunk_check(chunk)`` (the server's own check of what a chunk carries, so that a
    run takes what a served session takes) returns the chunk or raises a :class:`PipelineContractError`.
    ``on_blocked(line)``, which must not return, ends the process where the pipeline blocks trio's thread past a
    deadline, which no cancel scope can then keep (:mod:`pipelines.loop_watch`; the line names the call).
    ``warned``: a list of the caller's that the summary's warnings go to as they come (a run cancelled by a stop
    signal has no summary, and its stop then says them).
    ``out_dir`` is created if missing. On any failure or cancellation
    the temporary files are removed and nothing named ``video.mp4``/``metrics.json`` is written.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if isinstance(service, BidirectionalService):
        kind = "bidirectional"
    elif isinstance(service, ServerPushService):
        kind = "server_push"
        if controls is not None and len(controls):
            raise ValueError("a server-push pipeline takes no controls; drop the controls file")
    else:
        raise TypeError(f"service must be a BidirectionalService or a ServerPushService, got {type(service).__name__}")
    entries = controls.entries if controls is not None else ()
    if isinstance(service, BidirectionalService) and service.supports_timeline:
        taken = [name for name in RUN_OPTIONS if name in config.options]
        if taken:  # the run would overwrite them without a word (a bad value, too, went unnoticed)
            raise ValueError(f"option(s) {taken} are set by the offline run itself (continuous, and chunks from "
                             f"the run's chunk count: --chunks); leave them out")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (problem := output_problem(out)) is not None:
        raise ValueError(problem)
    video_tmp = _temp_path(out, VIDEO_NAME)
    metrics_tmp = _temp_path(out, METRICS_NAME)
    writer = Mp4Writer(video_tmp)
    recorder = Recorder(kind, chunks, len(entries))
    watchdog = None if on_blocked is None else LoopWatchdog(on_blocked)
    if watchdog is not None:
        watchdog.start()
    try:
        async with trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel[Chunk](4)
            nursery.start_soon(_write_chunks, writer, receive)
            async with send:
                run = _Run(recorder, send, chunks, progress, deadlines, chunk_check,
                           warnings=[] if warned is None else warned)
                if isinstance(service, BidirectionalService):
                    await _run_bidirectional(service, config, entries, run)
                else:
                    await _run_server_push(service, config, run)
        metrics = recorder.metrics(writer)
        metrics_tmp.write_text(metrics_text(metrics), encoding="utf-8")
        video_path, metrics_path = out / VIDEO_NAME, out / METRICS_NAME
        if (problem := output_problem(out)) is not None:  # made meanwhile: neither output is replaced
            raise RuntimeError(problem)
        os.replace(video_tmp, video_path)
        os.replace(metrics_tmp, metrics_path)
    except BaseException as exc:
        writer.abort()
        for path in (video_tmp, metrics_tmp):
            path.unlink(missing_ok=True)
        telling = telling_error(exc, (ChunkFailed, PipelineContractError))
        if telling is exc:
            raise
        if telling.__traceback__ is None:  # made here, naming the group's errors: the group is its cause
            raise telling from exc
        raise telling from None
    finally:
        if watchdog is not None:
            watchdog.stop()
    return OfflineRunSummary(
        kind=kind,
        chunks=metrics["chunks"],
        frames=metrics["frames"],
        media_seconds=metrics["media_seconds"],
        wall_seconds=metrics["wall_seconds"],
        video_path=video_path,
        metrics_path=metrics_path,
        metrics=metrics,
        warnings=tuple(run.warnings),
    )

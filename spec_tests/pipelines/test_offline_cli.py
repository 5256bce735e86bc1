"""``chunkline run`` as a user meets it: stopped by a real signal mid-run it leaves no partial file and its exit
code says so; an option the pipeline does not know is bad input (exit 2), not silently ignored."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

import pipelines

from ..processes import end_popen
from .cli_runs import default_signals, read_stderr_until

REPLAY = str(Path(pipelines.__file__).parent / "replay")
HUNG_STAGE = str(Path(__file__).parent / "hung_stage_world.py")
PROGRESS_DEADLINE = 60.0  # seconds for the child to import its pipeline and write its first chunk
EXIT_DEADLINE = 30.0


def _start_long_run(out: Path, pipeline: str = REPLAY, *options: str) -> subprocess.Popen[bytes]:
    """A run far longer than the test: it is stopped by the signal, never by its end."""
    command = [sys.executable, "-m", "server.cli", "run", pipeline, "--chunks", "100000", *options, "--out", str(out)]

    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_signals)


def _chunks_done(progress: bytes) -> int:
    counts = re.findall(rb"(\d+)/\d+ chunks", progress)
    return int(counts[-1]) if counts else 0


def _wait_for_progress(process: subprocess.Popen[bytes]) -> bytes:
    """Read the child's stderr until its progress bar shows more chunks done than its writer's queue holds
    (4), so the writer has opened its temporary file."""
    return read_stderr_until(process, lambda seen: _chunks_done(seen) >= 10, "progress", within=PROGRESS_DEADLINE)


@pytest.mark.parametrize(("signal_number", "code", "message"), [
    (signal.SIGTERM, 143, b"terminated (SIGTERM); no output was written"),
    (signal.SIGINT, 130, b"interrupted; no output was written"),
])
def test_a_signal_mid_run_leaves_no_partial_file(tmp_path: Path, signal_number: int, code: int, message: bytes) -> None:
    out = tmp_path / "out"
    process = _start_long_run(out, REPLAY, "--option", "duration_seconds=86400")
    try:
        _wait_for_progress(process)
        assert [p.name for p in out.iterdir() if p.name.endswith(".partial")], "the run writes to a temporary file"
        process.send_signal(signal_number)
        _, err = process.communicate(timeout=EXIT_DEADLINE)
    finally:
        end_popen(process)
    assert process.returncode == code, err[-2000:]
    assert message in err
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_a_stopped_run_says_an_earlier_output_in_its_folder_is_not_its_own(tmp_path: Path) -> None:
    """An interrupted run into a folder holding an earlier run's video and metrics said only "no output was
    written" while the folder looked like a success; the earlier files stay as they were."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "video.mp4").write_bytes(b"an earlier run's video")
    (out / "metrics.json").write_text("{}")
    process = _start_long_run(out, REPLAY, "--option", "duration_seconds=86400")
    try:
        _wait_for_progress(process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=EXIT_DEADLINE)
    finally:
        end_popen(process)
    assert process.returncode == 130, err[-2000:]
    assert f"no output was written (the earlier video.mp4 and metrics.json in {out} are an earlier run's, unchanged)" \
        in err.decode(), err[-2000:]
    assert (out / "video.mp4").read_bytes() == b"an earlier run's video" and sorted(os.listdir(out)) == [
        "metrics.json", "video.mp4"]


def _stop_then_abort(process: subprocess.Popen[bytes], second: int, running: Callable[[], object]) -> bytes:
    """Once the run makes progress (and ``running()`` shows what it holds), Ctrl-C, then ``second`` during the
    stop; returns its stderr (the process is killed if it is still there)."""
    try:
        seen = _wait_for_progress(process)
        assert running(), "the run holds what the test looks for"
        process.send_signal(signal.SIGINT)
        seen = read_stderr_until(process, lambda text: b"stopping the run" in text, "stop message", seen,
                                 PROGRESS_DEADLINE)
        process.send_signal(second)
        _, err = process.communicate(timeout=EXIT_DEADLINE)
        return seen + err
    finally:
        end_popen(process)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_aborts_a_stop_that_waits_for_a_hung_stage(tmp_path: Path, second: int) -> None:
    """The first Ctrl-C stops in order, which waits for the hung stage up to the pipeline's close deadline
    (300 s); a second signal ends the run at once, with its temporary file gone and exit code 130."""
    out = tmp_path / "out"
    process = _start_long_run(out, HUNG_STAGE)
    err = _stop_then_abort(process, second, lambda: [p.name for p in out.iterdir() if p.name.endswith(".partial")])
    assert process.returncode == 130, err[-2000:]
    assert b"press Ctrl-C again to abort" in err
    assert err.rstrip().endswith(b"chunkline run: aborted by a second signal; no output was written"), err[-500:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())


TOY_WORLD = str(Path(pipelines.__file__).parent / "toy_world")
PROCESS_PLACEMENT = ('{"mode": "process", "encode": {"devices": ["cpu"]}, "denoise": {"devices": ["cpu"]}, '
                     '"decode": {"devices": ["cpu"]}}')


def _segments_of(pid: int) -> list[str]:
    """The shared-memory segments of the channels process ``pid`` created (their names carry its pid)."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"cl_{pid}-"))


def test_a_run_aborted_by_a_second_signal_leaves_no_shared_memory_behind(tmp_path: Path) -> None:
    """With its stages in processes, a run's tensors travel through /dev/shm; the abort ends the process with
    os._exit, which runs no finalizer: each left 6 segments there for good (a server some 70)."""
    out = tmp_path / "out"
    process = _start_long_run(out, TOY_WORLD, "--placement", PROCESS_PLACEMENT)
    err = _stop_then_abort(process, signal.SIGINT, lambda: _segments_of(process.pid))
    assert process.returncode == 130, err[-2000:]
    assert _segments_of(process.pid) == [], err[-500:]


def test_sighup_stops_a_run_in_order_leaving_no_partial_file_nor_shared_memory(tmp_path: Path) -> None:
    """A closed terminal (SIGHUP) ended the run by the default action: its temporary video and its stages'
    /dev/shm segments stayed for good, exit -1. It stops the run as Ctrl-C does, exit 128 + 1."""
    out = tmp_path / "out"
    process = _start_long_run(out, TOY_WORLD, "--placement", PROCESS_PLACEMENT)
    try:
        _wait_for_progress(process)
        assert [p.name for p in out.iterdir() if p.name.endswith(".partial")], "the run writes to a temporary file"
        assert _segments_of(process.pid), "the run's stages share memory"
        process.send_signal(signal.SIGHUP)
        _, err = process.communicate(timeout=EXIT_DEADLINE)
    finally:
        end_popen(process)
    assert process.returncode == 129, err[-2000:]
    assert err.rstrip().endswith(b"chunkline run: hung up (SIGHUP); no output was written"), err[-500:]
    assert _segments_of(process.pid) == [] and not out.exists()


@pytest.mark.parametrize(("signal_number", "words"), [
    (signal.SIGINT, "interrupted"),
    (signal.SIGTERM, "terminated (SIGTERM)"),  # -15, nothing said
    (signal.SIGHUP, "hung up (SIGHUP)"),  # -1, nothing said
])
def test_a_stop_signal_before_the_run_started_ends_it_in_one_line_with_its_code(tmp_path: Path, signal_number: int,
                                                                              words: str) -> None:
    """A signal while the command still imports what it needs (here: while the pipeline is imported, which
    sends it to its own process) came before any handler of the command: SIGTERM and SIGHUP ended the process by
    the signal itself, and a Ctrl-C earlier still was a KeyboardInterrupt traceback. The command handles them from
    its first line: one line, exit code 128 + the signal, and the --out folder it had made is gone."""
    pipeline = tmp_path / "signalling_pipeline.py"
    pipeline.write_text(f"import os\nos.kill(os.getpid(), {int(signal_number)})\n\ndef get_service(gpu_num=0):\n"
                        f"    raise RuntimeError('not to be reached')\n")
    out = tmp_path / "out"
    process = _start_long_run(out, str(pipeline))
    try:
        _, err = process.communicate(timeout=EXIT_DEADLINE)
    finally:
        end_popen(process)
    assert process.returncode == 128 + signal_number, err[-2000:]
    assert err.decode().strip().splitlines() == [f"chunkline run: {words}; no output was written"], err[-2000:]
    assert not out.exists()


def test_segments_a_killed_run_left_are_removed_by_the_next_one(tmp_path: Path) -> None:
    """kill -9 leaves a process no way to unlink anything: the next process that makes a channel removes the
    segments of channels whose process is gone (their names carry its pid)."""
    process = _start_long_run(tmp_path / "out", TOY_WORLD, "--placement", PROCESS_PLACEMENT)
    try:
        _wait_for_progress(process)
        process.kill()
        process.communicate(timeout=EXIT_DEADLINE)
    finally:
        end_popen(process)
    left = _segments_of(process.pid)
    assert left, "a SIGKILL leaves its segments"
    result = subprocess.run([sys.executable, "-m", "server.cli", "run", TOY_WORLD, "--chunks", "2", "--placement",
                             PROCESS_PLACEMENT, "--out", str(tmp_path / "next")], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _segments_of(process.pid) == []


@pytest.mark.parametrize(("given", "words"), [
    ("deep", "is nested too deep to be a placement"),  # a RecursionError: a service restarted for ever under a server
    ("/dev/zero", "is not a regular file"),  # it said "no such file"
    ("large", "is larger than 1024 KiB"),
    ("[1, 2, 3]", "inline placement JSON must be an object, got list"),  # valid JSON, no placement: "no such file"
])
def test_a_placement_that_cannot_be_one_exits_2_saying_why(tmp_path: Path, given: str, words: str) -> None:
    if given == "deep":
        (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
        given = str(tmp_path / "deep.json")
    elif given == "large":
        with (tmp_path / "large.json").open("wb") as file:
            file.truncate((1 << 20) + 1)
        given = str(tmp_path / "large.json")
    result = subprocess.run([sys.executable, "-m", "server.cli", "run", TOY_WORLD, "--chunks", "1", "--placement",
                             given, "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and words in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_run_help_says_what_the_first_and_second_ctrl_c_do() -> None:
    result = subprocess.run([sys.executable, "-m", "server.cli", "run", "--help"], capture_output=True,
                            text=True, check=True)
    text = " ".join(result.stdout.split())
    assert "Ctrl-C (or SIGTERM) stops the run in order" in text
    assert "a second Ctrl-C (or SIGTERM) aborts at once" in text


def test_an_option_the_toy_world_does_not_know_exits_2_naming_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main

    out = tmp_path / "out"
    toy_world = str(Path(pipelines.__file__).parent / "toy_world")
    assert main(["run", toy_world, "--chunks", "1", "--option", "seeed=3", "--out", str(out)]) == 2
    # the flag is named, as every other flag's refusal names its flag (it said only "toy world: unknown option(s)")
    assert "chunkline run: --option: toy world: unknown option(s) ['seeed']" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(("command", "said"), [
    (["run", "--chunk", "3"], "chunkline run: error: unrecognized arguments: --chunk 3"),
    (["run", "--o", "x"], "chunkline run: error: unrecognized arguments: --o x"),
    (["stream-serve", "--max-sessions", "2"], "chunkline stream-serve: error: unrecognized arguments: --max-sessions 2"),
    (["worker", "--authority", "tcp://127.0.0.1:1", "--max-session", "2"],
     "chunkline worker: error: unrecognized arguments: --max-session 2"),
])
def test_a_flag_is_taken_by_its_whole_name_only(command: list[str], said: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--chunk 3`` ran 3 chunks (argparse took a prefix of ``--chunks``), and a flag added later could have made the
    same prefix another flag's: every command takes a flag by its whole name."""
    from server.cli import main

    toy_world = str(Path(pipelines.__file__).parent / "toy_world")
    name, *flags = command
    monkeypatch.chdir(tmp_path)  # a run taken after all writes its default folder here, not into the checkout
    with pytest.raises(SystemExit) as exited:
        main([name, toy_world, *flags])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == f"{said} (see {said.split(': error')[0]} --help)"


@pytest.mark.parametrize(("flag", "value"), [("--seed", "3"), ("--device", "cpu")])
def test_a_flag_the_replay_pipeline_has_no_use_for_exits_2_naming_it(tmp_path: Path, flag: str, value: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The replay pipeline has no randomness and no device: its get_service took any option and ignored it, so
    ``--seed 3`` and ``--device cpu`` ran as if they were not given."""
    from server.cli import main

    out = tmp_path / "out"
    replay = str(Path(pipelines.__file__).parent / "replay")
    assert main(["run", replay, "--chunks", "1", flag, value, "--out", str(out)]) == 2
    assert f"does not accept [{flag.removeprefix('--')!r}]" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("option", ["chunks=three", "chunks=5", "continuous=false"])
def test_an_option_the_run_sets_itself_exits_2_naming_it(tmp_path: Path, option: str) -> None:
    """The toy world applies the script itself, so the run sets its ``chunks`` and ``continuous``: a user's own
    value (even a bad one, ``chunks=three``) was overwritten without a word and the run exited 0."""
    out = tmp_path / "out"
    toy_world = str(Path(pipelines.__file__).parent / "toy_world")
    result = subprocess.run([sys.executable, "-m", "server.cli", "run", toy_world, "--chunks", "2", "--option", option,
                             "--out", str(out)], capture_output=True, text=True, timeout=EXIT_DEADLINE)
    assert result.returncode == 2, result.stderr[-2000:]
    name = option.partition("=")[0]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"['{name}']" in lines[0] and "--chunks" in lines[0], result.stderr
    assert not out.exists()


@pytest.mark.parametrize(("first", "second"), [(signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)])
def test_a_second_signal_after_the_stop_finished_still_aborts_with_the_first_signals_code(first: int,
                                                                                         second: int) -> None:
    """Between the orderly stop's end and the process's exit, a second signal must not end the process by
    itself (it showed -2, not 130, and no line; a Ctrl-C after a SIGTERM's stop exited 130, not 143: trio
    put Python's default SIGINT handler back as its run ended): the handlers stay, and it aborts as during
    the stop."""
    from server.run_signals import StoppedBySignal, trio_run_until_signalled

    aborted: list[int] = []

    class Aborted(Exception):
        pass

    def abort(first: int):  # the CLI's ends the process; here it says what it would have done
        aborted.append(first)
        raise Aborted

    async def run() -> None:
        os.kill(os.getpid(), first)
        await trio.sleep_forever()

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh process has it
        with pytest.raises(StoppedBySignal):
            trio_run_until_signalled(run, on_stop=lambda number: None, abort=abort)
        with pytest.raises(Aborted):
            os.kill(os.getpid(), second)  # the stop is over; the process would now be on its way out
        assert aborted == [first]  # the first signal's code, as during the stop
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


@pytest.mark.parametrize("stopped_by_a_signal", [True, False])
def test_a_signal_in_the_interpreters_last_teardown_keeps_the_first_signals_status(stopped_by_a_signal: bool) -> None:
    """Python puts the default action back on every signal it had a handler for, then tears the interpreter down:
    a second signal then (here sent by an object that goes with the last module) killed a process a signal had
    stopped (-15 from both `chunkline run` and `chunkline stream-serve`, nothing said) instead of letting it end
    with its status. Once a stop signal was noted the teardown ignores it; a process no signal stopped keeps the
    default (a signal still ends it)."""
    program = f"""
import os, signal, sys
from server import run_signals

class GoesLast:
    def __del__(self):  # runs as the interpreter tears __main__ down, after the exit calls
        os.kill(os.getpid(), signal.SIGTERM)

going_last = GoesLast()
signal.signal(signal.SIGTERM, lambda number, frame: None)  # a handler of Python's own, as both commands have
if {stopped_by_a_signal}:
    run_signals.note_stop_signal()
sys.exit(130)
"""
    root = Path(pipelines.__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", program], cwd=root, capture_output=True, timeout=60)
    assert result.returncode == (130 if stopped_by_a_signal else -signal.SIGTERM), result.stderr.decode()[-2000:]

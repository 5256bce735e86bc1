"""``chunkline run`` from the command line: a replay run end to end (h264 + AAC, metrics.json), the progress
bar on a terminal, a run with timed controls, and bad input that exits 2 writing nothing (what ``run_offline`` does
underneath: test_offline_run.py; a run stopped by a signal: test_offline_cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest

import pipelines
from pipelines.timed_controls import MAX_CONTROLS_FILE_BYTES
from server.cli import main

from .cli_runs import write_png
from .offline_helpers import EXPECTED_COUNTERS, METRIC_KEYS, SUMMARY_KEYS, TIMED, decoded_video, files_in

REPLAY = str(Path(pipelines.__file__).parent / "replay")


# --- chunkline run ------------------------------------------------------------------------------------------


def test_chunkline_run_replay_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["run", REPLAY, "--chunks", "3", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    # stderr is no terminal here: progress comes as plain lines (a bar redrawn per chunk filled logs)
    assert "3/3 chunks" in captured.err and "\r" not in captured.err
    assert "real-time factor" in captured.out and str(out / "video.mp4") in captured.out
    assert files_in(out) == ["metrics.json", "video.mp4"]

    frames, kinds = decoded_video(out / "video.mp4")
    assert len(frames) == 3 * 8  # frames_per_chunk defaults to 8
    assert frames[0].shape == (192, 320, 3)
    assert "audio" in kinds
    with av.open(str(out / "video.mp4")) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        assert container.streams.video[0].format.name == "yuv420p"
        audio = container.streams.audio[0]
        assert (audio.codec_context.name, audio.sample_rate) == ("aac", 48000)
        assert sum(f.samples for f in container.decode(audio=0)) >= 3 * 24000

    metrics = json.loads((out / "metrics.json").read_text())
    assert METRIC_KEYS <= set(metrics)
    assert metrics["kind"] == "server_push"
    assert (metrics["chunks"], metrics["frames"], metrics["media_seconds"]) == (3, 24, 1.5)
    assert metrics["audio"] == {"sample_rate": 48000, "channels": 1, "seconds": 1.5}
    assert set(metrics["chunk_period"]) == SUMMARY_KEYS and metrics["chunk_period"]["count"] == 2
    assert metrics["real_time_factor"] > 0


def write_counter_pipeline(tmp_path: Path, signature: str = "gpu_num=0") -> str:
    path = tmp_path / "counter_pipeline.py"
    path.write_text(
        "from spec_tests.pipelines.offline_helpers import CounterWorld\n\n"
        f"def get_service({signature}):\n"
        "    return CounterWorld()\n"
    )
    return str(path)


def test_the_progress_bar_is_drawn_on_a_terminal(tmp_path: Path) -> None:
    """``chunkline run`` with its stderr on a terminal (a pty): the bar, redrawn in place."""
    terminal, its_other_end = os.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "server.cli", "run", REPLAY, "--chunks", "3", "--out",
                               str(tmp_path / "out")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=its_other_end, timeout=300, cwd=Path(pipelines.__file__).parents[1])
        os.close(its_other_end)
        shown = b""
        while True:
            try:
                piece = os.read(terminal, 65536)
            except OSError:  # EIO: the writer's end is closed and everything was read
                break
            if not piece:
                break
            shown += piece
    finally:
        os.close(terminal)
    assert done.returncode == 0, shown
    assert b"\r[" in shown and b"3/3 chunks" in shown, shown


def test_a_summary_nobody_reads_does_not_fail_a_run_that_wrote_its_output(tmp_path: Path) -> None:
    """``chunkline run ... | head -1``: the reader closed stdout before the summary. The run had written its output,
    and it said ``the run failed: BrokenPipeError`` and exited 1, the files left in place."""
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "server.cli", "run", REPLAY, "--chunks", "2", "--out", str(out)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           cwd=Path(pipelines.__file__).parents[1])
    assert run.stdout is not None
    run.stdout.close()  # no reader: the summary's first write gets EPIPE
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    assert b"failed" not in err and b"Traceback" not in err and b"Exception ignored" not in err, err[-2000:]
    assert files_in(out) == ["metrics.json", "video.mp4"]


def test_chunkline_run_with_controls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    controls = tmp_path / "controls.json"
    controls.write_text(json.dumps(TIMED))
    image = tmp_path / "ref.png"
    write_png(image, 8, 8)  # the counter world ignores it; the run checks it as a create's (a PNG, of a size)
    pipeline = write_counter_pipeline(tmp_path, "gpu_num=0, seed=None")
    out = tmp_path / "out"
    args = ["run", pipeline, "--controls", str(controls), "--chunks", "8", "--out", str(out)]
    assert main([*args, "--seed", "3", "--prompt", "a street", "--image", str(image)]) == 0
    frames, _ = decoded_video(out / "video.mp4")
    means = [float(np.mean(frames[i * 4 : i * 4 + 4])) for i in range(8)]
    assert means == pytest.approx([100 + 20 * c for c in EXPECTED_COUNTERS], abs=4)
    summary = capsys.readouterr().out
    assert "7 pushed, 1 rejected, 1 not reached" in summary and "8 chunks, 32 frames" in summary


def test_the_summary_of_one_chunk_says_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", REPLAY, "--chunks", "1", "--out", str(tmp_path / "out")]) == 0
    assert "output            1 chunk, 8 frames " in capsys.readouterr().out  # it said "1 chunks"


def sparse_file(path: Path, size: int) -> str:
    """A file of ``size`` bytes that takes no room on disk (a hole)."""
    with path.open("wb") as file:
        file.truncate(size)
    return str(path)


def bad_controls(tmp_path: Path, content: str) -> str:
    path = tmp_path / f"controls{len(list(tmp_path.glob('controls*.json')))}.json"
    path.write_text(content)
    return str(path)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_pipeline", "does not exist"),
        ("missing_image", "--image: no such file"),
        ("missing_controls", "--controls: no such file"),
        ("malformed_controls", ".json': not valid JSON (Expecting"),  # said once (it read "is not valid JSON: not valid JSON")
        ("unknown_control", "controls entry 1: unknown control 'jump'"),
        ("cuda_unavailable", "no CUDA device"),
        ("bad_option", "replay option 'fps'"),
        ("controls_for_server_push", "takes no --controls"),
        ("seed_not_accepted", "does not accept ['seed']"),
        ("zero_chunks", "--chunks must be >= 1"),
        ("bad_option_syntax", "is not KEY=VALUE"),
        # one prompt rule everywhere (a create and a room take at most 2000 characters of encodable text)
        ("long_prompt", "--prompt is 2001 characters; at most 2000"),
        ("long_prompt_in_controls", "controls entry 0: 'prompt' is 2001 characters; at most 2000"),
        ("lone_surrogate_in_controls", "a string holds a lone surrogate"),
        ("undecodable_prompt", "--prompt is not valid text"),  # argv bytes that are not UTF-8 (surrogateescape)
        ("duplicate_key_in_controls", "key 't' appears twice in one object"),
        ("deeply_nested_controls", "JSON nested 100000 levels deep; at most 32"),
        ("huge_controls", "is larger than 16 MiB, the most a run reads"),  # read whole first: 20 x its size
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    case: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    reset_then = '[{"t": 0, "type": "reset"}, {"t": 1, "type": "control", "control": "jump", "event": "press"}]'
    args = {
        "missing_pipeline": ["run", str(tmp_path / "nope.py")],
        "missing_image": ["run", REPLAY, "--image", str(tmp_path / "nope.png")],
        "missing_controls": ["run", REPLAY, "--controls", str(tmp_path / "nope.json")],
        "malformed_controls": ["run", REPLAY, "--controls", bad_controls(tmp_path, "[{")],
        "unknown_control": ["run", REPLAY, "--controls", bad_controls(tmp_path, reset_then)],
        "cuda_unavailable": ["run", REPLAY, "--device", "cuda"],
        "bad_option": ["run", REPLAY, "--option", "fps=0"],
        "controls_for_server_push": ["run", REPLAY, "--controls", bad_controls(tmp_path, '[{"t": 0, "type": "reset"}]')],
        "seed_not_accepted": ["run", write_counter_pipeline(tmp_path), "--seed", "3"],
        "zero_chunks": ["run", REPLAY, "--chunks", "0"],
        "bad_option_syntax": ["run", REPLAY, "--option", "fps"],
        "long_prompt": ["run", REPLAY, "--prompt", "x" * 2001],
        "undecodable_prompt": ["run", REPLAY, "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")],
        "long_prompt_in_controls": ["run", REPLAY, "--controls", bad_controls(tmp_path, json.dumps(
            [{"t": 0, "type": "prompt", "prompt": "x" * 2001}]))],
        "lone_surrogate_in_controls": ["run", REPLAY, "--controls", bad_controls(
            tmp_path, '[{"t": 0, "type": "prompt", "prompt": "\\ud800"}]')],
        "duplicate_key_in_controls": ["run", REPLAY, "--controls", bad_controls(
            tmp_path, '[{"t": 0, "t": 1, "type": "reset"}]')],
        "deeply_nested_controls": ["run", REPLAY, "--controls", bad_controls(tmp_path, "[" * 100_000 + "]" * 100_000)],
        "huge_controls": ["run", REPLAY, "--controls", sparse_file(tmp_path / "huge.json", MAX_CONTROLS_FILE_BYTES + 1)],
    }[case]
    if case == "cuda_unavailable":
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if "--chunks" not in args:
        args += ["--chunks", "2"]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not (out / "video.mp4").exists()
    assert files_in(out) == []
    assert not out.exists()

"""``chunkline run``'s flags as a user meets them: each bad value is one line naming its flag and saying what is
wrong, exit code 2, before the pipeline loads (the pipelines here note that they were loaded), with a long value
shown cut; a pipeline that calls ``sys.exit()`` is a pipeline failure (exit 1), never a silent success."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipelines

ROOT = Path(pipelines.__file__).resolve().parents[1]
TOY_WORLD = str(ROOT / "pipelines" / "toy_world")
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import what it needs and end (a loaded 2-core host)
PNG_HEAD = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000400000004008020000002512e3f7")  # 64x64 RGB


GOOD_ENTRY = '{"t": 0, "type": "reset"}'
#: the bad entry of each controls file that holds one, after a good one
BAD_ENTRIES = {
    "type list": '{"t": 1, "type": ["reset"]}',
    "type object": '{"t": 1, "type": {"a": 1}}',
    "t of 400 digits": '{"t": 1' + "0" * 399 + ', "type": "reset"}',
    "control list": '{"t": 1, "type": "control", "control": ["w"]}',
    "key object": '{"t": 1, "type": "control_state", "controls": ["w", {"w": 1}]}',
}
#: controls files too large: too many entries, or too many values, 16 MiB of the smallest entries
LARGE_CONTROLS = {"200,001 entries": 200_001, "16 MiB of entries": (16 << 20) // 23 - 1}
BAD_CONTROLS = [*BAD_ENTRIES, *LARGE_CONTROLS]


def bad_controls(given: str) -> str:
    if given in LARGE_CONTROLS:
        return f"[{','.join([GOOD_ENTRY.replace(' ', '')] * LARGE_CONTROLS[given])}]"
    return f"[{GOOD_ENTRY}, {BAD_ENTRIES[given]}]"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-m", "server.cli", "run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL)


def noting_pipeline(tmp_path: Path) -> tuple[str, Path]:
    """A pipeline file that notes it was imported (a file ``loaded`` beside it), and its note."""
    path = tmp_path / "noting_pipeline.py"
    note = tmp_path / "loaded"
    path.write_text(f"from pathlib import Path\nPath({str(note)!r}).touch()\n\ndef get_service(gpu_num=0):\n"
                    f"    raise RuntimeError('not to be reached')\n")
    return str(path), note


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chunkline run: "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(("given", "words"), [
    ("under a file", "cannot be made: a part of its path is a file, not a directory"),  # NotADirectoryError, exit 1
    ("dangling link", "is a symbolic link to nothing"),  # FileExistsError, exit 1
    ("loop of links", "is a loop of symbolic links"),  # FileExistsError, exit 1
    ("long name", "has a name too long for the file system"),  # the whole name repeated, exit 1
    ("empty", "--out is empty"),  # it wrote into the current directory
])
def test_an_out_that_cannot_be_a_folder_is_refused_naming_it_before_the_pipeline_loads(tmp_path: Path, given: str,
                                                                                     words: str) -> None:
    pipeline, loaded = noting_pipeline(tmp_path)
    (tmp_path / "file").write_text("a file")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    out = {"under a file": str(tmp_path / "file" / "out"), "dangling link": str(tmp_path / "dangling"),
           "loop of links": str(tmp_path / "loop-a"), "long name": str(tmp_path / ("o" * 300)), "empty": ""}[given]
    work = tmp_path / "work"
    work.mkdir()
    result = run(pipeline, "--chunks", "1", "--out", out, cwd=work)
    line = one_line(result)
    assert result.returncode == 2 and line.startswith("chunkline run: --out ") and words in line, line
    assert "o" * 81 not in line and len(line) < 300, line
    assert not loaded.exists(), "the pipeline was loaded before --out was checked"
    assert os.listdir(work) == [] and not os.path.lexists(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["video.mp4", "metrics.json"])
def test_an_output_name_taken_by_a_folder_is_refused_before_the_pipeline_loads(tmp_path: Path, name: str) -> None:
    """A folder where the run's video.mp4 or metrics.json goes was found only as the run ended (exit 1 after the
    whole run), and with metrics.json a folder the earlier video.mp4 was replaced by a run that then failed."""
    pipeline, loaded = noting_pipeline(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / name).mkdir()
    earlier = "video.mp4" if name == "metrics.json" else "metrics.json"
    (out / earlier).write_text("an earlier run's")
    result = run(pipeline, "--chunks", "1", "--out", str(out))
    line = one_line(result)
    assert result.returncode == 2 and line.startswith(f"chunkline run: --out {str(out)!r}: ") and name in line, line
    assert "is a directory" in line, line
    assert not loaded.exists(), "the pipeline was loaded before --out was checked"
    assert sorted(os.listdir(out)) == sorted([name, earlier]) and (out / earlier).read_text() == "an earlier run's"


#: `chunkline run`, each folder under `made_first` made by "another run" just before this one makes it: the race of
#: runs making sibling outputs at once (`--out sib/a/b/c/run1`, `.../run2`), without its timing
RUN_AFTER_ANOTHER_MADE_THE_FOLDERS = """\
import os, sys
made_first, real_mkdir = sys.argv.pop(1), os.mkdir

def mkdir_after_another_run(path, *args, **kwargs):
    if str(path).startswith(made_first) and not os.path.lexists(path):
        real_mkdir(path)
    return real_mkdir(path, *args, **kwargs)

os.mkdir = mkdir_after_another_run
from server.cli import main
sys.exit(main())
"""


def test_folders_of_out_another_run_makes_first_are_used_not_refused(tmp_path: Path) -> None:
    """Runs into sibling folders made at once: one whose ``mkdir`` found a folder just made by another exited 2 with
    "cannot be made: a part of its path is a symbolic link to nothing"; a folder there now is one to use."""
    out = tmp_path / "sib" / "a" / "run1"
    command = [sys.executable, "-c", RUN_AFTER_ANOTHER_MADE_THE_FOLDERS, str(tmp_path / "sib"), "run",
               str(ROOT / "pipelines" / "replay"), "--chunks", "1", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["metrics.json", "video.mp4"]


def test_run_help_says_an_earlier_output_in_out_is_replaced() -> None:
    result = subprocess.run([sys.executable, "-m", "server.cli", "run", "--help"], capture_output=True, text=True,
                            check=True, timeout=RUN_DEADLINE)
    assert "a video.mp4 and a metrics.json already in it are replaced" in " ".join(result.stdout.split())


@pytest.mark.parametrize(("flag", "given", "words"), [
    ("--option", "deep", "--option 'x': its JSON value is nested too deep"),  # a RecursionError, exit 1
    ("--option", "twice", "--option 'resolution' is given twice"),  # the last one won without a word
    ("--controls", "long", "--controls: 'xxxx"),  # the 5,000 characters repeated whole
    ("--placement", "long", "--placement: 'xxxx"),
    ("--controls", "loop", "is a loop of symbolic links"),  # "no such file"
    ("--image", "loop", "is a loop of symbolic links"),
    ("--chunks", str(2**64), "--chunks must be at most 2**63"),  # "option 'chunks'", once the pipeline had loaded
    ("--image", "large", "has 9437184 bytes; a reference image is at most 8388608 bytes"),  # 300 MB were taken
    # 500 worker processes were spawned (the host ran out of memory); checked before the pipeline loads
    ("--placement", "500 ranks", "--placement: stage 'encode' asks for 500 ranks (one worker process each); a stage "
                                 "has at most 16"),
    ("--placement", "36 ranks", "--placement: the stages ask for 36 ranks in all ('encode' 12, 'denoise' 12, "
                                "'decode' 12); a placement has at most 32"),
    ("--prompt", "a\rb", "--prompt holds a control character (0x0d) at character 1 (carriage return); of the "
                         "control characters only tab and newline are allowed"),  # taken, against the README's rule
    # each field of a controls entry, of a type or a size Python's own error met (exit 1): TypeError, OverflowError
    ("--controls", "type list", "controls entry 1: unknown or missing type list ['reset'] (known: "),
    ("--controls", "type object", "controls entry 1: unknown or missing type dict {'a': 1} (known: "),
    ("--controls", "t of 400 digits", "controls entry 1: 't' must be a finite number >= 0 (seconds), got 1000"),
    ("--controls", "control list", "controls entry 1: 'control' must be a key's name (text), got list ['w']"),
    ("--controls", "key object", "controls entry 1: 'controls' item 1: a control must be a key's name (text), got "
                                 "dict {'w': 1}"),
    ("--controls", "200,001 entries", "200001 entries; at most 200000 are allowed"),
    ("--controls", "16 MiB of entries", "values; at most 2600000 allowed (a controls file holds at most 200000 "
                                        "entries)"),  # refused before it is parsed (5.8 s)
])
def test_a_bad_flag_value_is_one_line_naming_the_flag_before_the_pipeline_loads(tmp_path: Path, flag: str,
                                                                                given: str, words: str) -> None:
    pipeline, loaded = noting_pipeline(tmp_path)
    controls = tmp_path / "controls.json"
    if given in BAD_CONTROLS:
        controls.write_text(bad_controls(given))
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({stage: {"devices": ["cpu"] * 12} for stage in ("encode", "denoise", "decode")}
                                    | {"mode": "process"}))
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    large = tmp_path / "large.png"
    with large.open("wb") as file:  # a valid PNG's start, 9 MiB in all
        file.write(PNG_HEAD)
        file.truncate(9 << 20)
    values = {"deep": ["x=" + "[" * 30_000 + "]" * 30_000], "twice": ["resolution=160x96", "resolution=320x192"],
              "long": ["x" * 5000], "loop": [str(tmp_path / "loop-a")], "large": [str(large)],
              "500 ranks": [json.dumps({"mode": "process", "encode": {"devices": ["cpu"] * 500},
                                        "denoise": {"devices": ["cpu"]}, "decode": {"devices": ["cpu"]}})],
              "36 ranks": [str(placement)], **dict.fromkeys(BAD_CONTROLS, [str(controls)])}.get(given, [given])
    args = [word for value in values for word in (flag, value)]
    result = run(pipeline, *args, "--out", str(tmp_path / "out"))
    line = one_line(result)
    assert result.returncode == 2 and words in line, line
    assert len(line) < 400 and ("(5000 characters in all)" in line) == (given == "long"), line
    assert ("(400 characters in all)" in line) == (given == "t of 400 digits"), line  # a long value shown cut
    assert not loaded.exists(), "the pipeline was loaded before the flag was checked"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("given", "words"), [
    ("directory", "is a directory without an __init__.py, not a pipeline package"),  # "does not exist"
    ("pipe", "is not a regular file (a pipe, a socket or a device)"),
    ("/dev/zero", "is not a regular file (a pipe, a socket or a device)"),
    ("loop", "is a loop of symbolic links"),
])
def test_a_pipeline_path_that_cannot_be_a_pipeline_says_what_it_is(tmp_path: Path, given: str, words: str) -> None:
    path = tmp_path / "pipeline"
    if given == "directory":
        path.mkdir()
    elif given == "pipe":
        os.mkfifo(path)
    elif given == "loop":
        os.symlink(tmp_path / "other", path)
        os.symlink(path, tmp_path / "other")
    result = run("/dev/zero" if given == "/dev/zero" else str(path), "--out", str(tmp_path / "out"))
    line = one_line(result)
    assert result.returncode == 2 and line.startswith("chunkline run: pipeline '") and words in line, line


EXITS_AT_IMPORT = "import sys\nsys.exit(0)\n"
EXITS_IN_GET_SERVICE = "def get_service(gpu_num=0):\n    raise SystemExit(0)\n"
EXITS_DURING_THE_RUN = """
from spec_tests.pipelines.minimal_service import MinimalService


class Exits(MinimalService):
    async def chunks(self, session_id):
        import sys
        import numpy as np
        from pipelines.contract import Chunk
        yield Chunk(0, np.zeros((2, 8, 8, 3), np.uint8), 8.0)
        sys.exit(0)


def get_service(gpu_num=0):
    return Exits()
"""


@pytest.mark.parametrize(("body", "when"), [  # where: the pipeline's line that called it
    (EXITS_AT_IMPORT, "while being imported (at exiting_pipeline.py, line 2)"),
    (EXITS_IN_GET_SERVICE, "in get_service() (at exiting_pipeline.py, line 2)"),
    (EXITS_DURING_THE_RUN, "during the run (at exiting_pipeline.py, line 11)"),
], ids=["import", "get_service", "run"])
def test_a_pipeline_that_calls_sys_exit_fails_the_run_naming_it(tmp_path: Path, body: str, when: str) -> None:
    """``sys.exit(0)`` in a pipeline ended the run with exit code 0, no output and no word: CI read a success."""
    path = tmp_path / "exiting_pipeline.py"
    path.write_text(body)
    out = tmp_path / "out"
    result = run(str(path), "--chunks", "3", "--out", str(out))
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"chunkline run: the run failed: pipeline {str(path)!r} called sys.exit(0) {when}"), result.stderr[-2000:]
    assert not out.exists()


def test_a_controls_and_a_placement_file_saved_with_a_byte_order_mark_are_read(tmp_path: Path) -> None:
    """Windows' Notepad starts a UTF-8 file with a byte-order mark: such a controls file was refused in Python's words
    (``Unexpected UTF-8 BOM (decode using utf-8-sig)``), exit 2, and such a placement file by the pipeline."""
    controls, placement = tmp_path / "controls.json", tmp_path / "placement.json"
    controls.write_bytes(b"\xef\xbb\xbf" + b'[{"t": 0, "type": "reset"}]')
    stages = {stage: {"devices": ["cpu"]} for stage in ("encode", "denoise", "decode")}
    placement.write_bytes(b"\xef\xbb\xbf" + json.dumps({"mode": "in-process", **stages}).encode())
    result = run("pipelines/toy_world", "--chunks", "1", "--controls", str(controls), "--placement", str(placement),
                 "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [entry["type"] for entry in metrics["controls"]["entries"]] == ["reset"], metrics["controls"]

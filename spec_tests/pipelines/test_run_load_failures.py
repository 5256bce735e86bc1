"""``chunkline run`` on a pipeline that does not load, as a new author meets it: whose fault it is, in the exit code
and in one line.

The user's bad input exits 2: no pipeline at the path (no such file, no ``get_service`` in it), an option a flag
gives that ``get_service`` does not take or refuses (``ValueError``), the flag named. The pipeline's failure exits 1,
``the run failed: pipeline bug: ...`` for its bug, as the same bug in ``create_session`` does and as the server
counts it (a worker that failed, not one that refused its settings): its import or ``get_service()`` raising, a
``get_service`` that returns no service or takes no ``gpu_num``. Every load failure exited 2, as if the user's
arguments were wrong; the line did not say where the error was raised, a message of several lines took several, an
error without words ended in ``raised RuntimeError: ``, ``return`` forgotten read ``returned NoneType``, and a
helper module beside the pipeline read only ``No module named 'helper'``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_DEADLINE = 120.0  # wall seconds for `chunkline run` to import its pipeline and fail
MINIMAL = "from spec_tests.pipelines.minimal_service import MinimalService\n"


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def run(pipeline: Path, *flags: str) -> tuple[int, str]:
    """``chunkline run PIPELINE --chunks 2 --out OUT FLAGS``: its exit code and its one line on stderr."""
    out = pipeline.parent / "out"
    done = subprocess.run([sys.executable, "-m", "server.cli", "run", str(pipeline), "--chunks", "2", "--out", str(out),
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=RUN_DEADLINE,
                          stdin=subprocess.DEVNULL)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not out.exists()  # nothing left behind
    return done.returncode, lines[0]


BUGS = {
    "get_service_key_error": (MINIMAL + "SETTINGS = {}\n\ndef get_service(gpu_num=0):\n"
                              "    return MinimalService(chunks=SETTINGS['chunks'])\n",
                              "get_service() in {path!r} raised KeyError: 'chunks' (at p.py, line 5)"),
    "get_service_attribute_error": (MINIMAL + "def get_service(gpu_num=0):\n    service = MinimalService()\n"
                                    "    service.load_weights()\n    return service\n",
                                    "get_service() in {path!r} raised AttributeError: 'MinimalService' object has no "
                                    "attribute 'load_weights' (at p.py, line 4)"),
    "import_raises": ("import json\nSETTINGS = json.loads('{}')['size'] // 0\n",
                      "importing pipeline file {path!r} failed: KeyError: 'size' (at p.py, line 2)"),
    "syntax_error": ("def get_service(gpu_num=0)\n    return None\n",
                     "importing pipeline file {path!r} failed: SyntaxError: expected ':' (p.py, line 1)"),
    "returns_none": (MINIMAL + "def get_service(gpu_num=0):\n    service = MinimalService()\n",
                     "get_service() in {path!r} returned None (is its 'return' missing?); it must return a "
                     "BidirectionalService or a ServerPushService"),
    "returns_a_dict": ("def get_service(gpu_num=0):\n    return {'kind': 'bidirectional'}\n",
                       "get_service() in {path!r} returned dict; it must return a BidirectionalService or a "
                       "ServerPushService"),
    "no_gpu_num": (MINIMAL + "def get_service():\n    return MinimalService()\n",
                   "get_service() in {path!r} does not accept ['gpu_num']: chunkline calls every pipeline's "
                   "get_service(gpu_num=N), N the GPUs it is given; add a gpu_num=0 parameter"),
    "not_a_function": ("get_service = None\n", "get_service in {path!r} is a NoneType, not a function"),
    "a_parameter_never_given": (MINIMAL + "def get_service(model_path, gpu_num=0, *, size):\n"
                                "    return MinimalService()\n",
                                "get_service() in {path!r} requires ['model_path', 'size'], which it was not given "
                                "(chunkline gives gpu_num and the options set for it, by name): give each a default"),
    "message_of_lines": ("def get_service(gpu_num=0):\n    raise RuntimeError('no weights\\nlooked in ./w')\n",
                         "get_service() in {path!r} raised RuntimeError: no weights looked in ./w (at p.py, line 2)"),
    "message_of_no_words": ("def get_service(gpu_num=0):\n    raise RuntimeError()\n",
                            "get_service() in {path!r} raised RuntimeError (at p.py, line 2)"),
}


@pytest.mark.parametrize("case", sorted(BUGS))
def test_a_pipeline_s_own_bug_as_it_loads_exits_1_as_a_pipeline_bug_naming_its_line(tmp_path: Path, case: str) -> None:
    text, told = BUGS[case]
    path = write(tmp_path, "p.py", text)
    code, line = run(path)
    assert (code, line) == (1, "chunkline run: the run failed: pipeline bug: " + told.format(path=str(path)))


def test_a_bug_in_a_module_of_the_pipeline_s_package_names_that_module_s_line(tmp_path: Path) -> None:
    write(tmp_path, "pkg/__init__.py", "")
    write(tmp_path, "pkg/weights.py", "def load():\n    return {}['decoder']\n")
    path = write(tmp_path, "pkg/service.py", "from . import weights\n\ndef get_service(gpu_num=0):\n"
                 "    return weights.load()\n")
    code, line = run(path)
    assert (code, line) == (1, f"chunkline run: the run failed: pipeline bug: get_service() in {str(path)!r} raised "
                               f"KeyError: 'decoder' (at weights.py, line 2)")


def test_a_helper_module_beside_a_pipeline_file_is_said_to_need_a_package(tmp_path: Path) -> None:
    """A missing module may be the environment's (a package not installed): exit 1, not called the pipeline's bug."""
    write(tmp_path, "helper.py", "SIZE = 3\n")
    path = write(tmp_path, "p.py", "import helper\n")
    code, line = run(path)
    assert (code, line) == (1, f"chunkline run: the run failed: importing pipeline file {str(path)!r} failed: "
                               f"ModuleNotFoundError: No module named 'helper' (at p.py, line 1); helper.py beside it "
                               f"is not on the import path: chunkline imports the pipeline alone, not its folder: add "
                               f"an __init__.py to the folder and import it relatively ('from . import helper')")


def test_a_value_error_from_get_service_given_no_flag_s_option_is_no_bad_input(tmp_path: Path) -> None:
    """It refuses ``gpu_num=0``, which every run gives (or it is a bug such as ``int('abc')``): no flag can fix it."""
    path = write(tmp_path, "p.py", "def get_service(gpu_num=0):\n    return int('abc')\n")
    code, line = run(path)
    assert (code, line) == (1, f"chunkline run: the run failed: get_service() in {str(path)!r} refused its options: "
                               f"invalid literal for int() with base 10: 'abc' (given gpu_num=0 alone, which every "
                               f"chunkline run gives)")


SEEDED = MINIMAL + """
def get_service(gpu_num=0, seed=None):
    if seed is not None and seed > 10:
        raise ValueError(f"seed must be at most 10, got {seed}")
    return MinimalService()
"""


@pytest.mark.parametrize(("text", "flags", "told"), [
    (SEEDED, ["--seed", "11"], "--seed: get_service() in {path!r} refused its options: seed must be at most 10, got 11"),
    (SEEDED, ["--device", "cpu"], "--device: get_service() in {path!r} does not accept ['device']"),
    # it was exit 1, "the run failed: pipeline bug: loading ... raised BadInput: ..."
    (SEEDED, ["--placement", '{"mode": "process"}'], "--placement: pipeline {path!r} takes no placement (get_service "
                                                    "has no 'placement')"),
    ("def get_servce(gpu_num=0):\n    return None\n",
     [], "pipeline file {path!r} defines no get_service() function (it defines 'get_servce')"),
], ids=["seed_refused", "device_not_taken", "placement_not_taken", "misspelt_get_service"])
def test_the_user_s_bad_input_exits_2_naming_the_flag(tmp_path: Path, text: str, flags: list[str], told: str) -> None:
    path = write(tmp_path, "p.py", text)
    code, line = run(path, *flags)
    assert (code, line) == (2, "chunkline run: " + told.format(path=str(path)))


def test_a_placement_reaches_a_get_service_that_takes_any_keyword(tmp_path: Path) -> None:
    """``get_service(gpu_num=0, **options)`` takes ``--seed`` and ``--device``; ``--placement`` was refused, ``takes no
    placement (get_service has no 'placement')``. It reaches it as they do (here refused by it, naming the flag)."""
    path = write(tmp_path, "p.py", MINIMAL + "def get_service(gpu_num=0, **options):\n"
                                             "    raise ValueError(f'it got {sorted(options)}')\n")
    code, line = run(path, "--placement", '{"mode": "process"}')
    assert (code, line) == (2, f"chunkline run: --placement: get_service() in {str(path)!r} refused its options: it got "
                               f"['placement']")


def test_a_placement_for_a_pipeline_whose_import_fails_is_the_pipeline_s_bug(tmp_path: Path) -> None:
    """``--placement`` imports the pipeline first (to see that it takes one): the same failure, the same words."""
    path = write(tmp_path, "p.py", "import json\nSETTINGS = json.loads('{}')['size']\n")
    code, line = run(path, "--placement", "{}")
    assert (code, line) == (1, f"chunkline run: the run failed: pipeline bug: importing pipeline file {str(path)!r} "
                               f"failed: KeyError: 'size' (at p.py, line 2)")


def test_a_relative_import_in_a_file_outside_a_package_is_told_to_add_an_init(tmp_path: Path) -> None:
    write(tmp_path, "helper.py", "SIZE = 3\n")
    path = write(tmp_path, "p.py", "from .helper import SIZE\n")
    code, line = run(path)
    assert (code, line) == (1, f"chunkline run: the run failed: importing pipeline file {str(path)!r} failed: "
                               f"ImportError: attempted relative import with no known parent package (at p.py, line "
                               f"1); its folder has no __init__.py: add one, and the pipeline is imported as part of "
                               f"that package")


def test_a_pipeline_named_without_its_py_is_told_the_py_file_is_there(tmp_path: Path) -> None:
    write(tmp_path, "walker.py", MINIMAL + "def get_service(gpu_num=0):\n    return MinimalService()\n")
    code, line = run(tmp_path / "walker")
    assert code == 2 and line.startswith("chunkline run: pipeline '"), line
    assert line.endswith("walker' does not exist; 'walker.py' does: give the file's whole name"), line


def test_a_package_whose_get_service_is_in_a_module_of_it_names_that_module(tmp_path: Path) -> None:
    write(tmp_path, "pkg/__init__.py", "")
    service = write(tmp_path, "pkg/service.py", MINIMAL + "def get_service(gpu_num=0):\n    return MinimalService()\n")
    code, line = run(tmp_path / "pkg")
    assert (code, line) == (2, f"chunkline run: pipeline file {str(tmp_path / 'pkg')!r} defines no get_service() "
                               f"function (its service.py defines one: give {str(service)!r} as the pipeline, or "
                               f"import get_service in its __init__.py)")


@pytest.mark.parametrize(("given", "import_line", "told"), [
    ("pkg", "from .missing import SIZE", "No module named 'pkg.missing' (at __init__.py, line 1); a relative import in "
                                         "package {pkg!r} names missing.py (or a package folder missing/) in it"),
    ("pkg/p.py", "from .inner.missing import SIZE",
     "No module named 'pkg.inner' (at p.py, line 1); a relative import in package {pkg!r} names inner.py (or a package "
     "folder inner/) in it"),
], ids=["package", "file_in_a_package"])
def test_a_broken_relative_import_names_the_user_s_package_not_an_internal_module(
        tmp_path: Path, given: str, import_line: str, told: str) -> None:
    """A pipeline outside any installed package is imported under a name of chunkline's own: the error read
    ``No module named 'chunkline_pipeline_32595512542572144.missing'``, a name the user never gave."""
    pkg = tmp_path / "pkg"
    write(tmp_path, "pkg/__init__.py", import_line + "\n" if given == "pkg" else "")
    if given != "pkg":
        write(tmp_path, given, import_line + "\n\ndef get_service(gpu_num=0):\n    return None\n")
    code, line = run(tmp_path / given)
    assert (code, line) == (1, f"chunkline run: the run failed: importing pipeline file {str(tmp_path / given)!r} "
                               f"failed: ModuleNotFoundError: " + told.format(pkg=str(pkg)) + ", and there is none")
    assert "chunkline_pipeline" not in line

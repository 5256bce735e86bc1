"""What ``chunkline run`` checks before it loads the pipeline: each flag's value, refused in one line naming the flag
(:class:`BadInput`, exit code 2), a value too long to repeat shown cut (its first 80 characters and its length)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.paths import NO_SUCH_FILE, lookup_problem, regular_file_problem

from .reasons import echo

if TYPE_CHECKING:
    from pipelines.timed_controls import TimedControls

__all__ = ["BadInput", "OutDir", "check_chunks", "check_device", "check_image", "check_inputs_taken", "check_placement",
           "load_controls", "parse_options", "pipeline_path",
           "placement_option", "prepare_out", "regular_input", "shown"]

SHOWN = 80  # characters of a value a message repeats
MAX_CHUNKS = 2**63  # one chunk per sequence id of the engine (0..2**63-1)


class BadInput(Exception):
    """Input the user can fix: reported on stderr with exit code 2."""


def shown(value: str) -> str:
    """``value`` quoted for a message, cut to its first 80 characters and its length when longer."""
    return echo(value, SHOWN)


def check_chunks(chunks: int) -> None:
    if chunks < 1:
        raise BadInput(f"--chunks must be >= 1, got {chunks}")
    if chunks > MAX_CHUNKS:  # the pipeline said "option 'chunks'", and only once it was loaded
        raise BadInput(f"--chunks must be at most 2**63 (one chunk per sequence id), got {echo(str(chunks), 40)}")


def pipeline_path(text: str) -> Path:
    """The pipeline's path, if it can be one: a file or a package directory (a directory, a pipe or a loop of
    symbolic links was "does not exist")."""
    path = Path(text)
    try:
        info = os.stat(path)
    except OSError as exc:
        problem = lookup_problem(path, exc)
        if problem == NO_SUCH_FILE and path.name and path.with_name(f"{path.name}.py").is_file():
            problem += f"; {shown(path.name + '.py')} does: give the file's whole name"  # as a module's name
        raise BadInput(f"pipeline {shown(text)} {problem}") from None
    if stat.S_ISDIR(info.st_mode):
        if not (path / "__init__.py").is_file():
            raise BadInput(f"pipeline {shown(text)} is a directory without an __init__.py, not a pipeline package")
    elif not stat.S_ISREG(info.st_mode):
        raise BadInput(f"pipeline {shown(text)} is not a regular file (a pipe, a socket or a device)")
    return path


def regular_input(flag: str, path: str) -> None:
    """A file the run reads must be a regular file: say which it is not."""
    problem = regular_file_problem(path)
    if problem == NO_SUCH_FILE:
        raise BadInput(f"{flag}: no such file {shown(path)}")
    if problem is not None:
        raise BadInput(f"{flag}: {shown(path)} {problem}")


def load_controls(path: str) -> TimedControls:
    """``--controls``: a regular file, parsed into :class:`pipelines.timed_controls.TimedControls` with the server's
    parser of client JSON (an object naming a key twice, deep nesting, a lone surrogate refused as a request body's
    are), allowed as many values as the file's most entries need: the client limit, 20,000 values, refused a file
    of 5,000 entries, though 200,000 are allowed."""
    from pipelines.timed_controls import MAX_CONTROLS_ENTRIES, MAX_CONTROLS_VALUES, load_timed_controls

    from . import json_limits

    def loads(text: str) -> Any:
        try:
            return json_limits.loads(text, max_values=MAX_CONTROLS_VALUES)
        except json_limits.JsonRefused as exc:
            if exc.reason != "too_many_values":
                raise
            raise ValueError(f"{exc.detail} (a controls file holds at most {MAX_CONTROLS_ENTRIES} entries)") from None

    regular_input("--controls", path)
    try:
        return load_timed_controls(path, loads=loads)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def check_image(path: str) -> str:
    """``--image``: a regular file of at most the server's reference image limit, said before it is read."""
    from server.cluster.remote import MAX_IMAGE_BYTES  # the server's own limit on a reference image

    regular_input("--image", path)
    size = os.stat(path).st_size
    if size > MAX_IMAGE_BYTES:
        raise BadInput(f"--image: {shown(path)} has {size} bytes; a reference image is at most {MAX_IMAGE_BYTES} "
                       f"bytes ({MAX_IMAGE_BYTES >> 20} MiB), as the server takes them")
    return str(Path(path).resolve())


def check_inputs_taken(service: object, *, pipeline: str, prompt: str | None, image: str | None) -> None:
    """``--prompt`` and ``--image``, refused for a pipeline whose service declares it does not take them
    (``takes_prompt`` / ``takes_image``); checked once the pipeline is loaded, as only its ``get_service`` says
    which service (and so which declaration) it is. They were taken and the run made without them."""
    from pipelines.contract import input_not_taken, inputs_taken

    taken = inputs_taken(service)
    for flag, name, value in (("--prompt", "prompt", prompt), ("--image", "image", image)):
        if value is not None and name not in taken:
            raise BadInput(f"{flag}: {input_not_taken(name, shown(pipeline))}")


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``--option KEY=VALUE``: VALUE as JSON when it is JSON (with the server's limits on client JSON), else text."""
    from server import json_limits

    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"--option {shown(item)} is not KEY=VALUE")
        if key in options:  # the last one won without a word
            raise BadInput(f"--option {shown(key)} is given twice; give each option once")
        try:
            value: Any = json_limits.loads(raw)
        except json_limits.JsonRefused as exc:
            if exc.reason == "too_deep":
                raise BadInput(f"--option {shown(key)}: its JSON value is nested too deep ({exc.detail})") from None
            if exc.reason != "invalid_json":
                raise BadInput(f"--option {shown(key)}: its JSON value is refused: {exc.detail}") from None
            value = raw  # not JSON: text
        options[key] = value
    return options


def check_device(device: str | None) -> None:
    if device == "cuda":
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a dependency
            raise BadInput(f"--device cuda: torch is not importable ({exc})") from exc
        if not torch.cuda.is_available():
            raise BadInput("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")


def check_placement(placement: str, device: str | None) -> None:
    """``--placement`` names a regular file or is inline JSON starting with ``{`` (the pipeline reads either), and
    asks for no more worker processes than a placement may (:mod:`server.placement_size`): 500 ranks were spawned,
    and the host ran out of memory."""
    from server.placement_size import not_an_object, placement_problem

    if device is not None:
        raise BadInput("--device and --placement: give one (the placement names every stage's devices)")
    problem = None if placement.strip().startswith("{") else regular_file_problem(placement)
    if problem is None:
        if (refused := placement_problem(placement)) is not None:
            raise BadInput(f"--placement: {refused}")
        return
    if problem in (NO_SUCH_FILE, "has a name too long for the file system"):  # JSON meant inline?
        if (inline := not_an_object(placement)) is not None:
            raise BadInput(f"--placement: {inline}")
    if problem == NO_SUCH_FILE:
        raise BadInput(f"--placement: no such file {shown(placement)}")
    raise BadInput(f"--placement: {shown(placement)} {problem}")


def placement_option(pipeline: Path, placement: str) -> str:
    """The placement, once the pipeline's ``get_service`` is seen to take one (the pipeline validates it). A module
    that does not import raises its ``PipelineLoadError``, and one without a ``get_service`` function is left to the
    load to say so, for the caller to tell as it tells every load failure."""
    import inspect

    from pipelines.loader import load_pipeline_module

    factory = getattr(load_pipeline_module(pipeline), "get_service", None)
    parameters = inspect.signature(factory).parameters if callable(factory) else {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())  # as --seed, --device
    if callable(factory) and "placement" not in parameters and not takes_any:
        raise BadInput(f"--placement: pipeline {shown(str(pipeline))} takes no placement (get_service has no "
                       f"'placement')")
    return placement


class OutDir:
    """``--out``, made before the pipeline loads (so that it cannot fail after the run); :meth:`remove_made` takes
    back the folders it made, if they are still empty (a failed or stopped run leaves nothing). The run holds the
    folder (:func:`_claim`) until :meth:`release`, or until its process ends."""

    def __init__(self, path: Path, made: list[Path], claim: int | None = None) -> None:
        self.path = path
        self._made = made
        self._claim = claim

    def release(self) -> None:
        """Let another run have the folder (its outputs are written, or none will be)."""
        claim, self._claim = self._claim, None
        if claim is not None:
            os.close(claim)

    def remove_made(self) -> None:
        """Safe in a signal handler: ``rmdir`` calls only."""
        for folder in reversed(self._made):
            try:
                os.rmdir(folder)
            except OSError:
                return  # not empty (the run's output, or someone else's): it and its parents stay
        self._made = []


#: file systems the kernel makes itself (``/proc``, ``/sys``...): a folder there takes no file of a run's
KERNEL_FILE_SYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
                                 "pstore", "bpf", "efivarfs", "fusectl", "binfmt_misc", "devpts"})


def _unescaped(mount_point: str) -> str:
    """A mount point as ``/proc/self/mountinfo`` writes it (a space is ``\\040``), as the path it is."""
    return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), mount_point)


def kernel_file_system(path: Path) -> tuple[str, str] | None:
    """The file system of the kernel's own that ``path`` (or, where it does not exist, the folder it would be made in)
    is on, and its mount point: ``("proc", "/proc")``; None on any other, or where the mounts cannot be read."""
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            lines = mounts.read().splitlines()
    except (OSError, ValueError):
        return None
    found: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point = _unescaped(fields[4])
        kind = fields[fields.index("-", 6) + 1]
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if found is None or len(point) >= len(found[1]):  # the innermost mount (a later one over it wins)
                found = (kind, point)
    return found if found is not None and found[0] in KERNEL_FILE_SYSTEMS else None


def _cannot_make(text: str, exc: OSError) -> BadInput:
    why = {
        errno.ENOTDIR: "a part of its path is a file, not a directory",
        errno.ENAMETOOLONG: "a name in it is too long for the file system",
        errno.ELOOP: "a part of its path is a loop of symbolic links",
        errno.EEXIST: "a part of its path is a symbolic link to nothing",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    return BadInput(f"--out {shown(text)} cannot be made: {why}")


def _claim(path: Path, text: str) -> int | None:
    """Hold ``--out`` for this run: an exclusive ``flock`` on the folder itself (no file is left in it, and the kernel
    lets go of it when the process ends, however it ends); the descriptor that holds it, or None where the file
    system takes no lock. A folder another run holds is refused: two runs writing one folder at once renamed their
    files into place one by one, and could leave one run's ``video.mp4`` beside the other's ``metrics.json``."""
    try:
        held = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None  # looked at already: what keeps it from being written is said as the run writes
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(held)
        raise BadInput(f"--out {shown(text)} is the output folder of another chunkline run, still running: two runs "
                       f"into one folder could leave one's video.mp4 beside the other's metrics.json; give this run a "
                       f"folder of its own, or wait for that one to end") from None
    except OSError:  # a file system without locks (some network ones): the run goes on without the claim
        os.close(held)
        return None
    return held


def _write_problem(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (not ours to write, a read-only file system), or None: found by making
    one and removing it. A folder the user could not write ran the whole pipeline and then failed at its video
    (exit 1, ``PermissionError``)."""
    probe = folder / f".chunkline-run.{os.getpid()}.{secrets.token_hex(4)}.probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        return f"no file can be written in it: {exc.strerror or exc}"
    probe.unlink(missing_ok=True)
    return None


def prepare_out(text: str) -> OutDir:
    """``--out``: an existing directory (a symbolic link to one included), or one made now with its missing
    parents. A path under a file, a link to nothing or round in a loop, a name too long were a raw exception once
    the pipeline had loaded (exit 1); ``--out ""`` wrote into the current directory."""
    if not text:
        raise BadInput("--out is empty: give a directory (--out . for the current one)")
    try:  # absolute: a pipeline that changes the working directory put the output in its own, leaving --out empty
        path = Path(text).absolute()
    except OSError as exc:  # the working directory was removed
        raise BadInput(f"--out {shown(text)} cannot be made: the working directory is gone ({exc.strerror})") from None
    if (kernel := kernel_file_system(path)) is not None:  # before anything is made there (a cgroup, by a mkdir)
        kind, mount_point = kernel
        raise BadInput(f"--out {shown(text)} cannot be an output folder: it is on the kernel's {kind} file system "
                       f"({mount_point}), whose files the kernel makes itself, and no file of the run can be written "
                       f"there; give a folder on a disk")  # it said `no file can be written in it: No such file ...`
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise BadInput(f"--out {shown(text)} is a symbolic link to nothing (its target does not exist)") from None
        info = None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            raise _cannot_make(text, exc) from None
        raise BadInput(f"--out {shown(text)} {lookup_problem(path, exc)}") from None
    if info is not None:
        if not stat.S_ISDIR(info.st_mode):
            raise BadInput(f"--out {shown(text)} exists and is not a directory")
        from pipelines.offline import output_problem  # here, not at the top: 0.2 s of imports (numpy) for every flag check

        if (problem := output_problem(path) or _write_problem(path)) is not None:  # said before the run, not after it
            raise BadInput(f"--out {shown(text)}: {problem}")
        return OutDir(path, [], _claim(path, text))
    missing = [path]
    while not os.path.lexists(missing[-1].parent) and missing[-1].parent != missing[-1]:
        missing.append(missing[-1].parent)
    made: list[Path] = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError as exc:
            if os.path.isdir(folder):  # made since it was looked up (another run making its sibling): ours to use,
                continue  # not to take back; it failed this run as "a symbolic link to nothing"
            OutDir(path, made).remove_made()
            raise _cannot_make(text, exc) from None
        except OSError as exc:
            OutDir(path, made).remove_made()
            raise _cannot_make(text, exc) from None
        made.append(folder)
    # held at once: a run that finds the folder made by this one is refused (it is not taken back: another run that
    # came first may hold it, and it is that run's)
    return OutDir(path, made, _claim(path, text))


"""Load a pipeline file by path and check that what it offers fits the contract."""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import inspect
import re
import sys
import traceback
import weakref
from pathlib import Path
from types import ModuleType
from collections.abc import Mapping
from typing import Any

from .contract import BidirectionalService, ServerPushService, Service
from .error_text import error_line, error_words

__all__ = [
    "FILE_MODULE_PREFIX", "GpuNumNotTaken", "NotAPipeline", "OptionValuesRefused", "OptionsNotAccepted", "PipelineBug",
    "PipelineExited", "PipelineFailedToLoad", "PipelineLoadError", "load_pipeline_module", "load_service",
    "chunkline_folders", "offered_taken", "pipeline_folder", "record_offered_taken", "where",
]

#: the module name a pipeline file outside any package is imported under: only the process that loaded it has it
FILE_MODULE_PREFIX = "chunkline_pipeline_"


#: the offered settings each loaded service's ``get_service`` took (what the server may say the pipeline applies)
_TAKEN: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def offered_taken(service: object) -> frozenset[str] | None:
    """The names of the offered settings ``service``'s ``get_service`` took, or None when that is not known (a
    service not made by :func:`load_service`, nor recorded by whatever stands for one)."""
    try:
        return _TAKEN.get(service)
    except TypeError:  # not weak-referenceable (or not hashable): never recorded
        return None


def record_offered_taken(service: object, names: frozenset[str]) -> None:
    """Say which offered settings ``service`` took (e.g. a proxy, for the service its child loaded)."""
    try:
        _TAKEN[service] = frozenset(names)
    except TypeError:
        pass  # such a service's offers stay unknown


class PipelineLoadError(ValueError):
    """The pipeline file is missing, does not import, or does not fit the contract."""


class NotAPipeline(PipelineLoadError):
    """The path names no pipeline: no such file, not a ``.py`` file or package, a module without ``get_service``.
    The user's input, not the file's fault (``chunkline run`` exits 2)."""


class PipelineFailedToLoad(PipelineLoadError):
    """A pipeline that failed as it loaded for a reason no argument of the user's caused (``chunkline run`` exits
    1): as such, a module its import needs is missing or does not import (the environment's, or the pipeline's)."""


class PipelineBug(PipelineFailedToLoad):
    """The pipeline's own bug, found as it loaded: its import raised, its ``get_service()`` raised (other than
    ``ValueError``) or returned what is no service, or a method of its service is of a kind the contract cannot
    call. ``chunkline run`` says ``pipeline bug: ...`` and exits 1 (it exited 2, as if the user's input were bad)."""


class PipelineExited(PipelineBug):
    """The pipeline called ``sys.exit()`` (raised ``SystemExit``) while it was imported or its ``get_service()``
    ran: a pipeline bug. It ended the loading process with that code, ``sys.exit(0)`` as a success, saying nothing."""

    @classmethod
    def of(cls, path: str | Path, exc: SystemExit, when: str) -> PipelineExited:
        at = where(exc, pipeline_folder(path))  # the pipeline's own line that called it
        return cls(f"pipeline {str(path)!r} called sys.exit({exc.code!r}) {when}{at}")


class OptionsNotAccepted(PipelineLoadError):
    """``get_service()`` takes none of these options: loading it again with them fails the same way. ``names``: the
    options it does not take (empty when the error does not say, as one rebuilt from another process)."""

    names: tuple[str, ...] = ()


class GpuNumNotTaken(OptionsNotAccepted, PipelineBug):
    """``get_service()`` has no ``gpu_num``, which chunkline gives every pipeline: refused as any option is (a
    worker with it is not restarted), and the pipeline's bug, not a user's (``chunkline run`` exits 1)."""


class OptionValuesRefused(OptionsNotAccepted):
    """``get_service()`` raised ValueError: it refuses these options' values (a placement that cannot run, a
    resolution it does not make), and loading it again with them fails the same way."""


def load_pipeline_module(path: str | Path) -> ModuleType:
    """Import a pipeline file (``.py``) or package directory (with ``__init__.py``) by path."""
    path = Path(path)
    target = path / "__init__.py" if path.is_dir() else path
    if not target.is_file():
        raise NotAPipeline(f"pipeline file {str(path)!r} does not exist")
    if target.suffix != ".py":
        raise NotAPipeline(f"pipeline file {str(path)!r} is not a .py file or a package directory")
    importable = _importable_name(target)
    if importable is not None:
        # part of an installed package (e.g. pipelines/toy_world): import it by name so
        # its relative imports work and it is loaded once
        try:
            return importlib.import_module(importable)
        except SystemExit as exc:
            raise PipelineExited.of(path, exc, "while being imported") from None
        except Exception as exc:
            raise _import_failed(path, target, exc) from exc
    top, inner = _package_parts(target.absolute())  # 'svc.py' run from inside its package folder has a parent
    name = f"{FILE_MODULE_PREFIX}{abs(hash(str(top.resolve())))}"
    spec = importlib.util.spec_from_file_location(
        name, top / "__init__.py" if top.is_dir() else top, submodule_search_locations=[str(top)] if top.is_dir() else None
    )
    if spec is None or spec.loader is None:
        raise NotAPipeline(f"cannot import pipeline file {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        if inner:  # a module inside a package folder: imported as part of it, so its relative imports work
            module = importlib.import_module(".".join([name, *inner]))
    except BaseException as exc:
        for loaded in [key for key in sys.modules if key == name or key.startswith(f"{name}.")]:
            del sys.modules[loaded]
        if isinstance(exc, SystemExit):
            raise PipelineExited.of(path, exc, "while being imported") from None
        if not isinstance(exc, Exception):
            raise
        raise _import_failed(path, target, exc, imported_as=(name, top)) from exc
    return module


def _import_failed(path: str | Path, target: Path, exc: Exception,
                   imported_as: tuple[str, Path] | None = None) -> PipelineFailedToLoad:
    """The pipeline's import raised ``exc``: where (its own line that raised it), and for a module it could not
    import, whether that is a file beside it (importable only as part of a package). An ``ImportError`` may be the
    environment's (a package not installed): the rest are the pipeline's bugs. ``imported_as``: the module name a
    pipeline outside any installed package was imported under (``chunkline_pipeline_<n>``) and its file or package
    folder: an error naming it names the user's package instead (``No module named 'pkg.missing'``, not
    ``'chunkline_pipeline_3259....missing'``), and a relative import of a module that is not there says which file
    it looked for."""
    told = f"importing pipeline file {str(path)!r} failed: {error_line(exc)}{where(exc, target.parent)}"
    internal, top = imported_as if imported_as is not None else ("", target)
    if internal:
        told = re.sub(rf"\b{re.escape(internal)}\b", top.stem, told)
    if not isinstance(exc, ImportError):
        return PipelineBug(told)
    name = getattr(exc, "name", None) or ""
    if internal and isinstance(exc, ModuleNotFoundError) and name.startswith(f"{internal}."):
        relative = name[len(internal) + 1:].replace(".", "/")  # a relative import inside the pipeline's package
        return PipelineFailedToLoad(f"{told}; a relative import in package {str(top)!r} names {relative}.py (or a "
                                    f"package folder {relative}/) in it, and there is none")
    missing = name.partition(".")[0]
    beside = [name for name in (f"{missing}.py", f"{missing}/__init__.py") if missing and (target.parent / name).is_file()]
    if beside:
        told += (f"; {beside[0].partition('/')[0]} beside it is not on the import path: chunkline imports the "
                 f"pipeline alone, not its folder: add an __init__.py to the folder and import it relatively "
                 f"('from . import {missing}')")
    elif "no known parent package" in str(exc) and not (target.parent / "__init__.py").is_file():
        told += "; its folder has no __init__.py: add one, and the pipeline is imported as part of that package"
    return PipelineFailedToLoad(told)


def pipeline_folder(path: str | Path) -> Path:
    """The folder of a pipeline's own files: the package folder, or the file's."""
    return Path(path) if Path(path).is_dir() else Path(path).parent


@functools.cache
def chunkline_folders() -> tuple[Path, ...]:
    """Where chunkline's own code and Python's libraries are: a line there is not the pipeline's."""
    import sysconfig

    root = Path(__file__).resolve().parents[1]
    libraries = {sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return (*(root / name for name in ("engine", "pipelines", "server", "states")),
            *(Path(found).resolve() for found in libraries if found))


def where(exc: BaseException, folder: Path | None = None) -> str:
    """`` (at p.py, line 4)``: the last line of the pipeline's own files (under ``folder``, not chunkline's code or a
    library's) that ``exc`` passed, which a one-line failure named nowhere; empty when none did, and for a
    ``SyntaxError``, whose words name its line. With no ``folder`` (the server, which knows none), any file outside
    chunkline's code and the libraries is the pipeline's, named by its file name."""
    if isinstance(exc, SyntaxError):
        return ""
    root = None if folder is None else folder.resolve()
    others = [found for found in chunkline_folders() if root is None or not root.is_relative_to(found)]
    last = None
    for frame in traceback.extract_tb(exc.__traceback__):
        file = Path(frame.filename)
        if not file.is_absolute():
            continue  # '<frozen importlib._bootstrap>', '<string>'
        file = file.resolve()
        if (root is None or file.is_relative_to(root)) and not any(file.is_relative_to(other) for other in others):
            last = (Path(file.name) if root is None else file.relative_to(root), frame.lineno)
    return "" if last is None else f" (at {last[0]}, line {last[1]})"


def _package_parts(target: Path) -> tuple[Path, list[str]]:
    """The file or package folder to import first for ``target``, and the dotted names from it down to ``target``:
    a ``.py`` file in a folder with ``__init__.py`` is imported through its outermost such folder (it failed with
    'attempted relative import with no known parent package' when it had a relative import)."""
    if target.name == "__init__.py":
        return target.parent, []
    parts: list[str] = []
    folder, module = target.parent, target
    while (folder / "__init__.py").is_file() and folder.name.isidentifier() and module.stem.isidentifier():
        parts.insert(0, module.stem)
        folder, module = folder.parent, folder
    return module, parts


def _importable_name(target: Path) -> str | None:
    """The dotted module name ``target`` has on sys.path, if it is inside a package."""
    target = target.resolve()
    parts = [] if target.name == "__init__.py" else [target.stem]
    folder = target.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) < 1 or not all(p.isidentifier() for p in parts):
        return None
    dotted = ".".join(parts)
    try:
        found = importlib.util.find_spec(dotted)
    except (ImportError, ValueError):
        return None
    if found is None or found.origin is None or Path(found.origin).resolve() != target:
        return None
    return dotted


def load_service(path: str | Path, *, offered: Mapping[str, Any] | None = None, **options: Any) -> Service:
    """Call the file's ``get_service(**options)`` and validate what it returns.

    ``offered`` are settings the server hands to any pipeline that names them in
    ``get_service``'s signature (e.g. ``control_idle_timeout``, ``gpu_ids``); a
    pipeline that does not name one simply does not get it (``**kwargs`` does not count).
    """
    module = load_pipeline_module(path)
    if not hasattr(module, "get_service"):
        close = difflib.get_close_matches("get_service", [name for name in vars(module) if not name.startswith("__")],
                                          n=1, cutoff=0.75)
        hint = f" (it defines {close[0]!r})" if close else _defined_in_package(Path(path))
        raise NotAPipeline(f"pipeline file {str(path)!r} defines no get_service() function{hint}")
    factory = module.get_service
    if not callable(factory):
        raise PipelineBug(f"get_service in {str(path)!r} is a {type(factory).__name__}, not a function")
    if inspect.iscoroutinefunction(factory):  # it was called, its coroutine dropped unawaited with a RuntimeWarning
        raise PipelineBug(f"get_service() in {str(path)!r} is an 'async def'; it must be a plain 'def' that "
                          f"returns the service (load models in the service's running())")
    accepted = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(k for k in options if k not in accepted and not takes_any)
    if unknown:
        hint = (": chunkline calls every pipeline's get_service(gpu_num=N), N the GPUs it is given; add a "
                "gpu_num=0 parameter" if "gpu_num" in unknown else "")
        refused = (GpuNumNotTaken if "gpu_num" in unknown else OptionsNotAccepted)(
            f"get_service() in {str(path)!r} does not accept {unknown}{hint}")
        refused.names = tuple(unknown)
        raise refused
    named = {name for name, p in accepted.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    options = {**{k: v for k, v in (offered or {}).items() if k in named and k not in options}, **options}
    required = [name for name, p in accepted.items() if p.default is inspect.Parameter.empty and name not in options
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if required:  # it read Python's "missing 1 required positional argument", from inside chunkline, at no line
        raise PipelineBug(f"get_service() in {str(path)!r} requires {required}, which it was not given (chunkline "
                          f"gives gpu_num and the options set for it, by name): give each a default")
    try:
        service = factory(**options)
    except SystemExit as exc:
        raise PipelineExited.of(path, exc, "in get_service()") from None
    except ValueError as exc:  # the values are refused: no replacement worker is started to be refused again
        raise OptionValuesRefused(f"get_service() in {str(path)!r} refused its options: {error_words(exc)}") from exc
    except Exception as exc:
        at = where(exc, pipeline_folder(path))
        raise PipelineBug(f"get_service() in {str(path)!r} raised {error_line(exc)}{at}") from exc
    if isinstance(service, type) and issubclass(service, BidirectionalService | ServerPushService):
        raise PipelineBug(
            f"get_service() in {str(path)!r} returned the class {service.__name__}, not a service; it must return an "
            f"instance ({service.__name__}(...))"
        )
    if not isinstance(service, BidirectionalService | ServerPushService):
        returned = "None (is its 'return' missing?)" if service is None else type(service).__name__
        raise PipelineBug(
            f"get_service() in {str(path)!r} returned {returned}; it must return a BidirectionalService or a "
            f"ServerPushService"
        )
    problem = contract_shape_problem(service)
    if problem is not None:
        raise PipelineBug(f"{type(service).__name__} in {str(path)!r}: {problem}")
    record_offered_taken(service, frozenset(offered or {}) & named)
    return service


def _defined_in_package(folder: Path) -> str:
    """For a package folder whose ``__init__.py`` has no ``get_service``: the module of it that defines one, said as
    the pipeline to give (the folder was said to define none, and nothing more)."""
    if not folder.is_dir():
        return ""
    for module in sorted(folder.glob("*.py")):
        try:
            if re.search(r"^def get_service\(", module.read_text(errors="replace"), re.MULTILINE):
                return (f" (its {module.name} defines one: give {str(module)!r} as the pipeline, or import get_service "
                        f"in its __init__.py)")
        except OSError:
            continue
    return ""


_STREAMS = {"bidirectional": "chunks", "server_push": "stream"}


def contract_shape_problem(service: Service) -> str | None:
    """What in a service's methods cannot work with how the contract calls them, or None.

    ``running()`` is entered with ``async with``; ``chunks()``/``stream()`` are iterated with
    ``async for``. Told at load time, so the mistake is named instead of surfacing as a
    TypeError in the middle of a run.
    """
    running = service.running
    if inspect.iscoroutinefunction(running) or inspect.isasyncgenfunction(running):
        return ("running() is an 'async def'; it must return an async context manager "
                "(decorate it with @contextlib.asynccontextmanager)")
    decorated_by = _contextlib_decorator(running)
    if inspect.isasyncgenfunction(_unwrapped(running)) and decorated_by == "contextmanager":
        return ("running() is an 'async def' decorated with @contextlib.contextmanager; decorate it with "
                "@contextlib.asynccontextmanager")  # it loaded, then failed the run in Python's words
    if inspect.isgeneratorfunction(_unwrapped(running)):  # a plain 'def' with 'yield', @contextmanager or not
        if decorated_by == "asynccontextmanager":
            return ("running() is a plain 'def' with 'yield' decorated with @contextlib.asynccontextmanager; make "
                    "it an 'async def'")
        return ("running() is a plain 'def' with 'yield'; it must be an 'async def' decorated with "
                "@contextlib.asynccontextmanager (not @contextlib.contextmanager)")
    stream = _STREAMS[service.kind]
    if inspect.iscoroutinefunction(getattr(service, stream)):
        return (f"{stream}() is an 'async def' without 'yield'; it must be an async generator "
                f"(yield each Chunk) or return an async iterator")
    if inspect.isgeneratorfunction(getattr(service, stream)):
        return f"{stream}() is a plain 'def' with 'yield'; it must be an async generator ('async def' with 'yield')"
    for name in (*_AWAITED[service.kind], *_CALLED[service.kind]):
        found = inspect.getattr_static(service, name, None)  # not run: a @property is named as one
        if isinstance(found, property) or (found is not None and not callable(found)
                                            and not isinstance(found, classmethod)):
            what = "property" if isinstance(found, property) else type(found).__name__
            return f"{name} is a {what}, not a method; the contract calls it: make it a method"
    for name in _AWAITED[service.kind]:
        method = getattr(service, name, None)
        # a plain, undecorated 'def' (a @staticmethod too): what it returns is awaited ("object str can't be used in
        # 'await' expression")
        if _function(method) and not hasattr(method, "__wrapped__") and not (
                inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)):
            return f"{name}() is a plain 'def'; the contract awaits it: make it an 'async def'"
        if inspect.isasyncgenfunction(method):  # it failed at its first call ("object async_generator can't be ...")
            return (f"{name}() is an async generator ('async def' with 'yield'); the contract awaits it: take the "
                    "'yield' out")
    for name in _CALLED[service.kind]:
        # an 'async def' the contract calls without await: its work never ran (configure_session_capacity's, with a
        # RuntimeWarning) or its coroutine was read as the answer (memory_report's, an AttributeError at load)
        if inspect.iscoroutinefunction(method := getattr(service, name, None)) or inspect.isasyncgenfunction(method):
            return f"{name}() is an 'async def'; the contract calls it without awaiting it: make it a plain 'def'"
        if inspect.isgeneratorfunction(method):  # its body never ran: calling it only made a generator
            return f"{name}() is a plain 'def' with 'yield'; the contract calls it once: take the 'yield' out"
    if _function(getattr(service, "failure", None)):  # always "failed", and never said why
        return "failure is a method; it must be a property (decorate it with @property) or an attribute"
    return None


def _function(member: Any) -> bool:
    """A method, or a function found on the instance (a ``@staticmethod``)."""
    return inspect.ismethod(member) or inspect.isfunction(member)


#: the methods the contract awaits, and those it calls without awaiting, for each kind of service
_AWAITED = {"bidirectional": ("create_session", "check_options", "check_image", "push_control", "close_session"),
            "server_push": ("check_options", "check_image")}
_CALLED = {"bidirectional": ("memory_report", "configure_session_capacity"), "server_push": ()}


def _contextlib_decorator(method: Any) -> str | None:
    """``"contextmanager"`` or ``"asynccontextmanager"``: which of contextlib's decorators made ``method``, if one."""
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    qualname = getattr(code, "co_qualname", "")
    for name in ("asynccontextmanager", "contextmanager"):
        if getattr(code, "co_filename", None) == contextlib.__file__ and qualname.startswith(f"{name}."):
            return name
    return None


def _unwrapped(method: Any) -> Any:
    """The function under a method's decorators (those that name it with ``__wrapped__``, as contextlib's do)."""
    try:
        return inspect.unwrap(method)
    except ValueError:  # a cycle of __wrapped__: nothing to learn from it
        return method

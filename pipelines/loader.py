"""Load a pipeline file by path and check that what it offers fits the contract."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import weakref
from pathlib import Path
from types import ModuleType
from collections.abc import Mapping
from typing import Any

from .contract import BidirectionalService, ServerPushService, Service

__all__ = [
    "FILE_MODULE_PREFIX", "OptionValuesRefused", "PipelineExited", "OptionsNotAccepted", "PipelineLoadError", "load_pipeline_module", "load_service", "offered_taken", "record_offered_taken",
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


class PipelineExited(PipelineLoadError):
    """The pipeline called ``sys.exit()`` (raised ``SystemExit``) while it was imported or its ``get_service()``
    ran: a pipeline bug. It ended the loading process with that code, ``sys.exit(0)`` as a success, saying nothing."""

    @classmethod
    def of(cls, path: str | Path, exc: SystemExit, when: str) -> PipelineExited:
        return cls(f"pipeline {str(path)!r} called sys.exit({exc.code!r}) {when}")


class OptionsNotAccepted(PipelineLoadError):
    """``get_service()`` takes none of these options: loading it again with them fails the same way."""


class OptionValuesRefused(OptionsNotAccepted):
    """``get_service()`` raised ValueError: it refuses these options' values (a placement that cannot run, a
    resolution it does not make), and loading it again with them fails the same way."""


def load_pipeline_module(path: str | Path) -> ModuleType:
    """Import a pipeline file (``.py``) or package directory (with ``__init__.py``) by path."""
    path = Path(path)
    target = path / "__init__.py" if path.is_dir() else path
    if not target.is_file():
        raise PipelineLoadError(f"pipeline file {str(path)!r} does not exist")
    if target.suffix != ".py":
        raise PipelineLoadError(f"pipeline file {str(path)!r} is not a .py file or a package directory")
    importable = _importable_name(target)
    if importable is not None:
        # part of an installed package (e.g. pipelines/toy_world): import it by name so
        # its relative imports work and it is loaded once
        try:
            return importlib.import_module(importable)
        except SystemExit as exc:
            raise PipelineExited.of(path, exc, "while being imported") from None
        except Exception as exc:
            raise PipelineLoadError(
                f"importing pipeline file {str(path)!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    top, inner = _package_parts(target.absolute())  # 'svc.py' run from inside its package folder has a parent
    name = f"{FILE_MODULE_PREFIX}{abs(hash(str(top.resolve())))}"
    spec = importlib.util.spec_from_file_location(
        name, top / "__init__.py" if top.is_dir() else top, submodule_search_locations=[str(top)] if top.is_dir() else None
    )
    if spec is None or spec.loader is None:
        raise PipelineLoadError(f"cannot import pipeline file {str(path)!r}")
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
        raise PipelineLoadError(f"importing pipeline file {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


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
    factory = getattr(module, "get_service", None)
    if factory is None or not callable(factory):
        raise PipelineLoadError(f"pipeline file {str(path)!r} defines no get_service() function")
    if inspect.iscoroutinefunction(factory):  # it was called, its coroutine dropped unawaited with a RuntimeWarning
        raise PipelineLoadError(f"get_service() in {str(path)!r} is an 'async def'; it must be a plain 'def' that "
                                f"returns the service (load models in the service's running())")
    accepted = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(k for k in options if k not in accepted and not takes_any)
    if unknown:
        hint = (": chunkline calls every pipeline's get_service(gpu_num=N), N the GPUs it is given; add a "
                "gpu_num=0 parameter" if "gpu_num" in unknown else "")
        raise OptionsNotAccepted(f"get_service() in {str(path)!r} does not accept {unknown}{hint}")
    named = {name for name, p in accepted.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    options = {**{k: v for k, v in (offered or {}).items() if k in named and k not in options}, **options}
    try:
        service = factory(**options)
    except SystemExit as exc:
        raise PipelineExited.of(path, exc, "in get_service()") from None
    except ValueError as exc:  # the values are refused: no replacement worker is started to be refused again
        raise OptionValuesRefused(f"get_service() in {str(path)!r} refused its options: {exc}") from exc
    except Exception as exc:
        raise PipelineLoadError(f"get_service() in {str(path)!r} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(service, type) and issubclass(service, BidirectionalService | ServerPushService):
        raise PipelineLoadError(
            f"get_service() in {str(path)!r} returned the class {service.__name__}, not a service; it must return an "
            f"instance ({service.__name__}(...))"
        )
    if not isinstance(service, BidirectionalService | ServerPushService):
        raise PipelineLoadError(
            f"get_service() in {str(path)!r} returned {type(service).__name__}; it must return a "
            f"BidirectionalService or a ServerPushService"
        )
    problem = contract_shape_problem(service)
    if problem is not None:
        raise PipelineLoadError(f"{type(service).__name__} in {str(path)!r}: {problem}")
    record_offered_taken(service, frozenset(offered or {}) & named)
    return service


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
    if inspect.isgeneratorfunction(_unwrapped(running)):  # a plain 'def' with 'yield', @contextmanager or not
        return ("running() is a plain 'def' with 'yield'; it must be an 'async def' decorated with "
                "@contextlib.asynccontextmanager (not @contextlib.contextmanager)")
    stream = _STREAMS[service.kind]
    if inspect.iscoroutinefunction(getattr(service, stream)):
        return (f"{stream}() is an 'async def' without 'yield'; it must be an async generator "
                f"(yield each Chunk) or return an async iterator")
    if inspect.isgeneratorfunction(getattr(service, stream)):
        return f"{stream}() is a plain 'def' with 'yield'; it must be an async generator ('async def' with 'yield')"
    for name in _AWAITED[service.kind]:
        method = getattr(service, name, None)
        # a plain, undecorated 'def': what it returns is awaited ("object str can't be used in 'await' expression")
        if inspect.ismethod(method) and not hasattr(method, "__wrapped__") and not (
                inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)):
            return f"{name}() is a plain 'def'; the contract awaits it: make it an 'async def'"
    return None


#: the methods the contract awaits, for each kind of service
_AWAITED = {"bidirectional": ("create_session", "check_options", "push_control", "close_session"),
            "server_push": ("check_options",)}


def _unwrapped(method: Any) -> Any:
    """The function under a method's decorators (those that name it with ``__wrapped__``, as contextlib's do)."""
    try:
        return inspect.unwrap(method)
    except ValueError:  # a cycle of __wrapped__: nothing to learn from it
        return method

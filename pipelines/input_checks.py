"""A create's inputs, checked by the pipeline's own hooks (``check_options``, ``check_image``) in one call.

The server asks before it holds anything (:mod:`server.option_check`); a worker whose service runs in another
process or behind an agent's connection answers for both checks in one round trip, so each side calls this one
function, and a refusal is told apart by the input it names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .contract import PipelineContractError, Service
from .pipeline_exits import PipelineExit, exits_as_errors

__all__ = ["refused_input"]

#: what each check names when it refuses, as a check that raised otherwise is told
_REFUSAL = {"options": "naming an option it refuses, and return for options it takes",
            "image": "saying why it refuses an image, and return for one it takes"}


async def refused_input(service: Service, options: Mapping[str, Any] | None,
                        image_size: tuple[int, int] | None) -> tuple[str, str] | None:
    """What ``service``'s own checks refuse of a create, as ``(input, reason)``, or None: ``"options"`` from its
    ``check_options`` (unless ``options`` is None), else ``"image"`` from its ``check_image`` of ``image_size``
    (width, height; None: no image). Both in one call, so a check that crosses a process or a connection is one
    round trip. A check that raises other than ``ValueError`` is the pipeline's bug: :class:`PipelineContractError`
    naming it."""
    checks: list[tuple[str, str, Callable[..., Any], tuple[Any, ...]]] = []
    if options is not None:
        checks.append(("options", "check_options", service.check_options, (options,)))
    if image_size is not None:
        checks.append(("image", "check_image", service.check_image, tuple(image_size)))
    for what, hook, check, args in checks:
        try:
            with exits_as_errors(hook):  # a sys.exit() in a check: a pipeline bug (it was a 500 with an empty body)
                await check(*args)
        except ValueError as exc:
            return what, str(exc)
        except PipelineExit:
            raise
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise PipelineContractError(f"{hook} raised {raised} (it must raise ValueError {_REFUSAL[what]})") from exc
    return None

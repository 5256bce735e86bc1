"""The process service's errors, and the conversion of an error raised in the child."""

from __future__ import annotations

from pipelines.contract import ControlRejected, PipelineContractError
from pipelines.loader import OptionsNotAccepted

from .wire import ErrorInfo

__all__ = [
    "ProcessServiceCallTimeout", "ProcessServiceClosed", "ProcessServiceError", "ProcessServiceFailed",
    "ProcessServiceStartError", "ProcessServiceOptionsRefused", "RemoteServiceError", "remote_error",
]


class ProcessServiceError(RuntimeError):
    """Base of the process service's errors."""


def last_line(traceback_text: str, default: str) -> str:
    """A child's traceback told by its last line (the error itself), or ``default`` when it has none."""
    return (traceback_text.strip().splitlines()[-1:] or [default])[0]


class ProcessServiceStartError(ProcessServiceError):
    """The child could not load the pipeline (with its traceback), exited, or was not ready in time.

    ``child_error``: how the child failed in words that do not name this service or its process (the pipeline's own
    error line, or the exit code), so that two children failing alike can be told apart from two that did not; None
    when the failure says nothing of the next child (a timeout, a spawn that failed)."""

    def __init__(self, message: str, *, child_error: str | None = None) -> None:
        super().__init__(message)
        self.child_error = child_error


class ProcessServiceOptionsRefused(ProcessServiceStartError, OptionsNotAccepted):
    """The child's pipeline takes none of the options it was given (the loader's refusal, raised in the child):
    a new child would fail the same way."""


class ProcessServiceFailed(ProcessServiceError):
    """The child died or its pipe closed unexpectedly: every pending and later call fails with this."""


class ProcessServiceClosed(ProcessServiceError):
    """The service is not running (before ``running()``, or after it was left)."""


class ProcessServiceCallTimeout(ProcessServiceError):
    """The child did not answer a call within that call's deadline (:class:`~server.process_service.CallDeadlines`).

    The call was cancelled in the child, which keeps running; ``method`` is the call
    (``"running"`` for entering ``running()``), ``deadline`` its deadline in seconds.
    """

    def __init__(self, service: str, method: str, deadline: float) -> None:
        super().__init__(
            f"{service}: {method}() got no answer from the service process within its deadline of {deadline:g} s "
            f"(call_deadlines.{method}); the call was cancelled there"
        )
        self.method = method
        self.deadline = deadline


class RemoteServiceError(ProcessServiceError):
    """The service raised in the child; ``remote_traceback`` is the child's traceback text."""

    def __init__(self, message: str, *, method: str, remote_type: str, remote_message: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback


def remote_error(method: str, info: ErrorInfo) -> Exception:
    """The exception to raise in the parent for ``info``: ControlRejected or PipelineContractError again (the
    pipeline's bug says what it did wrong, as it does in-process), else a RemoteServiceError."""
    if info.reject_reason is not None:
        return ControlRejected(info.reject_reason)
    if info.contract_detail is not None:
        error = PipelineContractError(info.contract_detail)
        error.add_note(f"--- child traceback ---\n{info.traceback}")
        return error
    return RemoteServiceError(
        f"{method}() raised {info.type_name}: {info.message}\n--- child traceback ---\n{info.traceback}",
        method=method, remote_type=info.type_name, remote_message=info.message, remote_traceback=info.traceback,
    )

"""How an agent that never loaded its pipeline tells its launcher how the load failed.

An agent loads its pipeline before it dials the authority, so one whose load fails only exits (code 1): its launcher
saw an exit code and replaced it with backoff up to the crash-loop limit, each agent's traceback in the log, though
every replacement failed alike. The launcher names a file in the agent's environment (:data:`LOAD_FAILURE_ENV`); the
agent reads there how the slot's last agent failed its load (its own traceback is then not logged again) and removes
it, and writes its own load failure there before it exits. The launcher reads it back and hands it to the slot's
:class:`states.restart_policy.RestartTracker`, which gives the slot up when two agents that never loaded failed the
same way (LOAD_REPEATED), as in-process worker slots do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import attrs

from ..model_worker import LoadFailure

__all__ = ["LOAD_FAILURE_ENV", "LoadFailureNote", "read_load_failure", "take_load_failure", "write_load_failure"]

log = logging.getLogger("chunkline.cluster")

#: the environment variable naming the file (set by a launcher; an agent started by hand has none)
LOAD_FAILURE_ENV = "CHUNKLINE_LOAD_FAILURE_FILE"
MAX_BYTES = 64 * 1024  # a failure's words are one short line (public_reason); anything larger is not one


def read_load_failure(path: str) -> LoadFailure | None:
    """The load failure written at ``path``; None when there is none (the agent loaded, or ended otherwise) or it is
    not one (garbled: it then says nothing of the next load)."""
    try:
        with open(path, "rb") as file:
            data = json.loads(file.read(MAX_BYTES))
        return LoadFailure(str(data["kind"]), str(data["words"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("an agent's load failure at %s is unreadable: %s", path, exc)
        return None


def take_load_failure(path: str) -> LoadFailure | None:
    """The agent's side, as it starts: how the slot's last agent failed its load, removed so that a later exit of
    this agent for another reason is never read as a load failure."""
    failure = read_load_failure(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return failure


def write_load_failure(path: str, failure: LoadFailure) -> None:
    """The agent's side, before it exits: how its load failed (written whole, then renamed into place)."""
    partial = f"{path}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as file:
            json.dump({"kind": failure.kind, "words": failure.words}, file)
        os.replace(partial, path)
    except OSError as exc:  # the launcher then sees an exit code only: restarted with backoff, as a crash
        log.warning("could not tell the launcher how the load failed (%s): %s", path, exc)


@attrs.define
class LoadFailureNote:
    """An agent's end of the file: how the slot's last agent failed its load, and where to tell its own."""

    path: str | None
    told: LoadFailure | None = None

    @classmethod
    def from_environment(cls) -> LoadFailureNote:
        path = os.environ.get(LOAD_FAILURE_ENV) or None
        return cls(path, None if path is None else take_load_failure(path))

    def is_new(self, failure: LoadFailure) -> bool:
        """Whether the slot's last agent did not fail its load this way (only a new failure's traceback is logged)."""
        return failure != self.told

    def tell(self, failure: LoadFailure | None) -> None:
        """This agent's load failed (``failure`` None: in a way that says nothing of the next load)."""
        if self.path is not None and failure is not None:
            write_load_failure(self.path, failure)

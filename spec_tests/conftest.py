"""How the suite spreads over processes (pytest-xdist, from the ``test`` extra).

A plain ``pytest`` (and so ``make test``) runs in ``xdist_workers`` processes (``pyproject.toml``): most of the
suite's wall time is spent waiting on other processes (agents importing torch, handshake and drain deadlines,
a LiveKit server), not computing, so a few processes overlap those waits. Each test module is one unit of work
(``--dist loadfile``), run whole by one process in its order, so a module-scoped fixture (an authority and its
agents, a LiveKit server) starts once; the modules that run a LiveKit server or a browser are one unit together,
and so are the two that run Ray (:data:`ONE_AT_A_TIME`), so one such stack runs at a time. ``-n N`` chooses the
number of processes; ``-n 0`` or ``-p no:xdist`` runs everything in this process, as before (``--pdb`` too). A test past its deadline
(``timeout`` in ``pyproject.toml``) prints every thread's stack and ends its process, which ends the run.

(xdist's own ``--dist loadgroup`` cannot do the grouping here: it renames test ids, which pytest 9 ignores.)
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import traceback
from types import CoroutineType
from typing import Any

import pytest

#: test files that must not run beside each other, one unit each. LiveKit and the browser: each module holds a
#: LiveKit server in a network namespace, a stream server, SDK clients or a headless Chromium, and what they assert
#: includes their timing. Ray: a ray.cluster_utils.Cluster writes /tmp/ray/ray_current_cluster, and a plain
#: ray.init() (the Ray launcher with no address) joins the cluster that file names instead of starting its own.
ONE_AT_A_TIME = {
    "livekit-and-browser": ("spec_tests/livekit/", "spec_tests/e2e/test_browser.py"),
    "ray": ("spec_tests/cluster/test_ray.py", "spec_tests/cluster/test_launcher_order.py"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("xdist_workers", "processes a plain run uses when pytest-xdist is installed (0: none)", default="3")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Spread a run over ``xdist_workers`` processes unless told otherwise (``-n``, ``--dist``, ``--pdb``,
    ``-p no:xdist``), a module at a time; nothing in the processes xdist starts."""
    if not config.pluginmanager.has_plugin("xdist") or hasattr(config, "workerinput"):
        return
    option = config.option
    if option.usepdb or option.collectonly:
        return
    if option.numprocesses is None and option.dist == "no":
        option.numprocesses = int(config.getini("xdist_workers"))
    if option.numprocesses and option.dist == "no":  # `-n N` alone: by module too, not xdist's test by test
        option.dist = "loadfile"
        option.loadscopereorder = False  # collection order: the slow agent modules go first
    if option.numprocesses and option.maxworkerrestart is None:
        # a process ends only when a test overran its deadline (pytest-timeout); xdist would run that module again
        # in a new process from its start, and wait on it when the test hangs again: report it and stop instead
        option.maxworkerrestart = "0"


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    for group, prefixes in ONE_AT_A_TIME.items():
        if path.startswith(prefixes):
            return group
    return path


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown when xdist is absent or disabled (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the files of :data:`ONE_AT_A_TIME` one unit (other modes: xdist's own)."""
    if config.option.dist != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleScheduling(config, log)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook: unknown in a venv made before it
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's deadline, on an xdist process: its own report goes to the process's terminal output, which
    xdist discards, so a hang in CI showed nothing. This one writes the stacks to stderr, the run's own."""
    if not hasattr(item.config, "workerinput") or settings.method != "thread":
        return None
    timer = threading.Timer(settings.timeout, report_overrun, (item, settings.timeout))
    timer.name, timer.daemon = "test deadline", True
    timer.start()
    item.cancel_timeout = timer.cancel  # type: ignore[attr-defined]  # what pytest-timeout's cancel hook calls
    return True


def report_overrun(item: pytest.Item, timeout: float) -> None:
    """Every thread's stack, to stderr, then end the process (xdist reports the test as crashed). The process ends
    whatever the report meets: an error making it left the hung test running for ever (the deadline thread died)."""
    lines = [f"\n{'+' * 20} {item.nodeid}: past its {timeout:g} s deadline {'+' * 20}\n"]
    try:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(item)  # the test's output was captured: fd 2 is the run's stderr again
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            lines.append(f"--- thread {names.get(ident, ident)}\n")
            lines.extend(traceback.format_stack(frame))
        lines.append("--- suspended coroutines (a trio test waits in one of these), outermost first\n")
        lines.extend(f"  {chain}\n" for chain in suspended_coroutines())
    except BaseException as exc:  # noqa: BLE001  (a report cut short still names the test, and the process ends)
        lines.append(f"--- the report failed: {type(exc).__name__}: {exc}\n")
    finally:
        os.write(2, "".join(lines).encode(errors="replace"))
        os._exit(1)


def suspended_coroutines() -> list[str]:
    """Each chain of suspended coroutines, as ``file:line function -> ...``: a trio test that hangs shows its main
    thread idle in trio's I/O wait, and what it waits for is only in these."""
    # type(), not isinstance(): isinstance reads __class__, which some objects make warn (torch's reduce_op), an
    # error under -W error
    coroutines = [found for found in gc.get_objects() if type(found) is CoroutineType and found.cr_frame is not None]
    awaited = {id(coroutine.cr_await) for coroutine in coroutines}
    chains = []
    for root in coroutines:
        if id(root) in awaited:
            continue
        steps, node = [], root
        while node is not None and getattr(node, "cr_frame", None) is not None:
            code = node.cr_frame.f_code
            steps.append(f"{os.path.relpath(code.co_filename)}:{node.cr_frame.f_lineno} {code.co_qualname}")
            node = node.cr_await
        chains.append(" -> ".join(steps))
    return chains

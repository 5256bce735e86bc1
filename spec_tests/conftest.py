"""How the suite spreads over processes (pytest-xdist, from the ``test`` extra).

A plain ``pytest`` (and so ``make test``) runs in ``xdist_workers`` processes (``pyproject.toml``): most of the
suite's wall time is spent waiting on other processes (agents importing torch, handshake and drain deadlines,
a LiveKit server), not computing, so a few processes overlap those waits. Each test module is one unit of work
(``--dist loadfile``), run whole by one process in its order, so a module-scoped fixture (an authority and its
agents, a LiveKit server) starts once; the modules that run a LiveKit server or a browser are one unit together,
and so are the two that run Ray (:data:`ONE_AT_A_TIME`), so one such stack runs at a time. ``-n N`` chooses the
number of processes; ``-n 0`` or ``-p no:xdist`` runs everything in this process, as before (``--pdb`` too).

(xdist's own ``--dist loadgroup`` cannot do the grouping here: it renames test ids, which pytest 9 ignores.)
"""

from __future__ import annotations

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

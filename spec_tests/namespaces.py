"""Running a command in namespaces of its own (``unshare -r``: as root, or in a user namespace where allowed), for
what a test may not do to the host: listen on fixed ports (a network of its own, no packet leaves) or make a
read-only folder that root cannot write either (a mount of its own). In CI (``CI=true``) a host without them fails
the test; elsewhere it skips, naming why."""

from __future__ import annotations

import os
import subprocess

import pytest

__all__ = ["PRIVATE_NETWORK", "READ_ONLY_FOLDER", "unshare_or_skip"]

IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}
# ``sh -c`` scripts; the command follows as "$@"
#: (with ``-n``) loopback up, and one address that is not loopback (WebRTC media is advertised there)
PRIVATE_NETWORK = ("ip link set lo up && ip link add v0 type veth peer name v1 && "
                   "ip addr add 10.99.0.1/30 dev v0 && ip link set v0 up && exec \"$@\"")
#: (with ``-m``) the folder named first made read-only, then the rest run
READ_ONLY_FOLDER = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && exec "$@"'


def unshare_or_skip(flags: str, script: str, *args: str) -> list[str]:
    """The argv that runs ``sh -c script sh ARGS...`` under ``unshare flags``, once a trial run of the script
    showed this host allows it."""
    argv = ["unshare", flags, "sh", "-c", script, "sh"]
    trial = [*args[:1], "true"] if script == READ_ONLY_FOLDER else ["true"]
    try:
        done = subprocess.run([*argv, *trial], capture_output=True, text=True, timeout=30)
        reason = None if done.returncode == 0 else f"unshare {flags} failed: {done.stderr.strip()}"
    except FileNotFoundError:
        reason = "no unshare command"
    if reason is not None:
        if IN_CI:
            pytest.fail(f"CI=true: this test must run, never skip: {reason}")
        pytest.skip(reason)
    return [*argv, *args]

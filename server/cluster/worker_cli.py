"""``chunkline worker PIPE --authority URL [--devices 0,1] ...``: run one worker agent.

The cluster token comes from ``CHUNKLINE_CLUSTER_TOKEN`` (or ``--cluster-token-file``), never
from the command line, where other users of the host could read it. Exit codes: see
:data:`EXIT_CODES` (also the end of ``chunkline worker --help``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path
from typing import Any

__all__ = ["add_worker_parser", "cmd_worker"]

TOKEN_ENV = "CHUNKLINE_CLUSTER_TOKEN"
EXIT_CODES = ("Exit codes: 0 drained (a stop signal or the authority's drain, once it served), 1 failed (the model "
              "did not load, the authority stayed unreachable), 2 bad arguments, 3 refused (another version or "
              "pipeline, a wrong token, settings its pipeline refuses), 70 its --launcher-pid is gone, 128 + the "
              "signal for a stop before it served (130 for Ctrl-C).")


def add_worker_parser(commands: Any) -> argparse.ArgumentParser:
    worker = commands.add_parser(
        "worker",
        help="run a worker agent that dials in to a stream-serve authority",
        description=(
            "Run one worker agent: load PIPE on this host's devices, dial the authority, register, and run the "
            f"sessions it starts. The cluster token is read from {TOKEN_ENV} or --cluster-token-file."
        ),
        epilog=EXIT_CODES,
    )
    worker.add_argument("pipeline", metavar="PIPE", help="the same pipeline file or package the authority serves")
    worker.add_argument("--authority", metavar="URL", required=True, help="tcp://HOST:PORT or tls://HOST:PORT")
    worker.add_argument("--devices", metavar="IDS", default="", help="GPU ids of this agent, e.g. 0,1 (default: none)")
    worker.add_argument("--max-sessions", metavar="auto|N", default="auto", help="retained sessions (default auto)")
    worker.add_argument("--worker-mode", choices=("in-process", "process"), default="in-process",
                        help="process: the pipeline runs in a child process of the agent (default in-process)")
    worker.add_argument("--placement", metavar="FILE|JSON", default=None, help="where each stage runs")
    worker.add_argument("--node", metavar="NAME", default=socket.gethostname(), help="node name shown in health")
    worker.add_argument("--launcher", metavar="NAME", default="external", help="who started this agent")
    worker.add_argument("--slot", metavar="NAME", default=None, help="the launcher's slot (set by launchers)")
    worker.add_argument("--launcher-pid", metavar="PID", default=None,
                        help="exit when this process (the authority that started this agent) is gone (set by launchers)")
    worker.add_argument("--cluster-token-file", metavar="FILE", default=None,
                        help=f"read the token here, not {TOKEN_ENV} (a regular file of UTF-8 text, at most 4 KiB)")
    # refused, never read: without it ``--cluster-token SECRET`` (stream-serve's flag) was taken as an abbreviation of
    # --cluster-token-file, and the secret was printed as a missing file's name
    worker.add_argument("--cluster-token", dest="cluster_token_given", metavar="TOKEN", default=None,
                        help=argparse.SUPPRESS)
    worker.add_argument("--tls-ca", metavar="FILE", default=None, help="CA bundle (or the authority's own certificate) to verify a tls:// authority")
    worker.add_argument("--drain-deadline", metavar="SECONDS", default="30",
                        help="seconds live sessions get to finish on SIGTERM (default 30, at most 3600)")
    # what the authority's own workers get (its launchers pass its values; give them to external agents)
    worker.add_argument("--control-idle-timeout", metavar="SECONDS", default="10",
                        help="offered to a pipeline that takes control_idle_timeout (default 10)")
    worker.add_argument("--default-fps", metavar="FPS", default="16",
                        help="offered to a pipeline that takes an fps (1-120, default 16)")
    worker.add_argument("--skip-validation", action="store_true",
                        help="skip the startup check (one warm-up chunk checked against the contract)")
    return worker


def _devices(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        devices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--devices must be comma-separated GPU ids, got {text!r}") from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ValueError(f"--devices must be distinct ids >= 0, got {text!r}")
    return devices


def _fits_the_wire(args: argparse.Namespace, devices: tuple[int, ...]) -> None:
    """What the agent sends in its register is within the wire's bounds (else the authority refuses it)."""
    from .wire_values import device_indexes, label, node_name, opt_label

    for flag, value, check in (("--node", args.node, node_name), ("--launcher", args.launcher, label),
                               ("--slot", args.slot, opt_label), ("--devices", list(devices), device_indexes)):
        try:
            check(value)
        except TypeError as exc:
            raise ValueError(f"{flag}: {exc}") from None


def _node_names_a_participant(node: str) -> None:
    """The node's worker ids (``identity.new_worker_id``) must name a room participant (``worker_participant``): the
    authority refused any other for good (exit 3), once the pipeline had loaded and the startup check had run."""
    from ..reasons import echo
    from ..tokens import MAX_IDENTITY_LENGTH, IdentityError, validate_identity
    from .identity import WORKER_ID_DIGITS, worker_participant

    suffix = "-" + "0" * WORKER_ID_DIGITS  # the longest id a node gets: any digits have its length
    try:
        validate_identity(worker_participant(node + suffix))
    except IdentityError:
        most = MAX_IDENTITY_LENGTH - len(worker_participant(suffix))
        raise ValueError(f"--node: {echo(node)} cannot name this agent in its rooms: at most {most} characters, "
                         f"letters, digits and _ . : @ - only") from None


def _launcher_pid(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 2**22:
        raise ValueError(f"--launcher-pid must be a process id, got {text!r}")
    pid = int(text)
    if pid != os.getppid() and _running(pid):  # the agent could only read it as its launcher gone (exit 70)
        raise ValueError(f"--launcher-pid {pid} is not the process that started this agent (its parent is pid "
                         f"{os.getppid()}); it names the authority whose local launcher started the agent")
    return pid  # a launcher already gone is the agent's to notice, as one that goes later


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def _max_sessions(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 64:
        raise ValueError(f"--max-sessions must be 'auto' or 1-64, got {text!r}")
    return value


def cmd_worker(args: argparse.Namespace) -> int:
    import trio

    from ..cluster_settings import MIN_CLUSTER_TOKEN_BYTES
    from ..console import tell
    from ..gpu_devices import missing_gpus, ordinals_in_this_process
    from ..reasons import echo
    from ..log_setup import log_to_stderr
    from ..setting_values import parse_float, read_secret_file
    from .. import setting_fields
    from .agent import Agent, AgentOptions, parse_authority
    from .tls import client_tls_context
    from .wire_values import MAX_DRAIN_SECONDS

    prefix = "chunkline worker"
    try:
        if args.cluster_token_given is not None:
            raise ValueError(f"--cluster-token is not taken here (other users of this host can read a command line): "
                             f"set {TOKEN_ENV} or give --cluster-token-file")
        if parse_authority(args.authority)[0] == "tls":
            client_tls_context(args.tls_ca)
        elif args.tls_ca is not None:  # it was ignored: the agent dialed without TLS, its token in the clear
            raise ValueError(f"--tls-ca applies to a tls:// authority; with {echo(args.authority)} it would be "
                             f"ignored (the agent dials it without TLS)")
        devices = _devices(args.devices)
        _fits_the_wire(args, devices)
        _node_names_a_participant(args.node)
        max_sessions = _max_sessions(args.max_sessions)
        if not Path(args.pipeline).exists():
            raise ValueError(f"PIPE {args.pipeline!r} does not exist")
        placement = setting_fields.placement(args.placement)  # as stream-serve reads it: refused before any load
        if args.cluster_token_file is not None:
            token = read_secret_file("--cluster-token-file", args.cluster_token_file)
        else:
            token = os.environ.get(TOKEN_ENV, "")
        if not token:
            # the authority's own environment, copied, names its token file in a variable the worker does not read
            also = (f"; {TOKEN_ENV}_FILE is the server's: give its file as --cluster-token-file"
                    if os.environ.get(f"{TOKEN_ENV}_FILE") else "")
            raise ValueError(f"no cluster token: set {TOKEN_ENV} or give --cluster-token-file (the authority's token)"
                             f"{also}")
        if len(token.encode()) < MIN_CLUSTER_TOKEN_BYTES:
            raise ValueError(f"the cluster token ({TOKEN_ENV} or --cluster-token-file) must be at least "
                             f"{MIN_CLUSTER_TOKEN_BYTES} bytes")
        launcher_pid = _launcher_pid(args.launcher_pid)
        # at most what a drain through the API may take, and what the wire carries: a SIGTERM with 1e300 drained for ever
        drain_deadline = parse_float("--drain-deadline", args.drain_deadline, 0.0, MAX_DRAIN_SECONDS, lo_open=True)
        control_idle_timeout = parse_float("--control-idle-timeout", args.control_idle_timeout, 0.0, lo_open=True)
        default_fps = parse_float("--default-fps", args.default_fps, 1.0, 120.0)
        # the GPUs as this agent's environment names them (its launcher's CUDA_VISIBLE_DEVICES lists them)
        by_hand = args.launcher == "external"  # a launcher's come from its map (checked by the authority) or from
        # Ray's GPU resources (Ray's to declare): a mismatch there is logged, and the advice is not this agent's user's
        missing = missing_gpus(ordinals_in_this_process(devices), "--devices", named=devices, advise=by_hand)
        if missing is not None and by_hand:
            raise ValueError(missing)
    except (ValueError, OSError) as exc:
        tell(f"{prefix}: error: {exc}")  # a stderr closed or gone: still exit 2, and never on stdout
        return 2
    if devices and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    log_to_stderr()
    if missing is not None:
        logging.getLogger("chunkline.cluster").warning("%s (started by the %s launcher): %s", prefix, args.launcher, missing)
    options = AgentOptions(
        pipeline=args.pipeline,
        authority=args.authority,
        token=token,
        devices=devices,
        max_sessions=max_sessions,
        worker_mode=args.worker_mode,
        placement=placement,
        node=args.node,
        launcher=args.launcher,
        slot=args.slot,
        launcher_pid=launcher_pid,
        tls_ca=args.tls_ca,
        drain_deadline=drain_deadline,
        control_idle_timeout=control_idle_timeout,
        default_fps=default_fps,
        validate=not args.skip_validation,
    )
    from ..early_signals import defer

    defer()  # a stop signal as the run starts is noted, and replayed once the agent's receiver is open
    return trio.run(Agent(options).run)

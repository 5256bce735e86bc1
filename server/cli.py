"""The ``chunkline`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chunkline",
        description="Serve interactive, stateful, chunked generation.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("stream-serve", help="run the stream server for a pipeline file")
    serve.add_argument("pipeline", nargs="?", help="path of a pipeline file defining get_service()")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "stream-serve":
        print(
            "chunkline stream-serve: the stream server is not part of this build yet "
            "(see the open server issues); nothing was started.",
            file=sys.stderr,
        )
        return 2
    return 0  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())

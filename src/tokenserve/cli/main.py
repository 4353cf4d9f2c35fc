"""Entry point of the `tokenserve` console script."""

from __future__ import annotations

import argparse
import os
import sys

from tokenserve.errors import TokenserveError


def _quiet_tensorflow() -> None:
    # TF logs its C++ start-up chatter unless told otherwise before it is imported.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    from tokenserve.cli import export, generate, train

    parser = argparse.ArgumentParser(prog="tokenserve",
                                     description="Token generation serving on TensorFlow.")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (generate, export, train):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_tensorflow()
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except TokenserveError as error:
        print(f"tokenserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

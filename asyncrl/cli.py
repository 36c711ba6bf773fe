"""The ``asyncrl`` command line.

asyncrl bench transport [--json] [--quick]    transport figures, side by side
asyncrl version                               the package and wire-protocol versions
"""

from __future__ import annotations

import argparse
import sys

from asyncrl import __version__

BENCHMARKS = ("transport",)


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.name == "transport":
        from asyncrl.bench import transport

        return transport.main(rest)
    raise AssertionError(args.name)


def _version(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.transport.protocol import PROTOCOL_VERSION

    print(f"asyncrl {__version__} (wire protocol {PROTOCOL_VERSION})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``asyncrl`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="An asynchronous actor-model runtime for RL post-training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser("bench", help="run a benchmark and print its figures", add_help=False)
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.set_defaults(func=_bench)
    version = sub.add_parser("version", help="print the package and wire-protocol versions")
    version.set_defaults(func=_version)
    args, rest = parser.parse_known_args(argv)
    if rest and args.func is not _bench:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    result: int = args.func(args, rest)
    return result


if __name__ == "__main__":
    sys.exit(main())

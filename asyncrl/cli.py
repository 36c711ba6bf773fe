"""The ``asyncrl`` command line.

- ``asyncrl run MANIFEST [--set KEY=VALUE]... [--run-dir DIR]``: run a manifest on this machine.
- ``asyncrl bench transport [--json] [--quick]``: the transport's figures, side by side.
- ``asyncrl bench runtime [--json] [--kills N]``: crash detection, restart, handle overhead.
- ``asyncrl bench learner [--json]``: a learner step through a handle against plain PyTorch.
- ``asyncrl bench pipeline [--json] [--quick]``: sync against async mode on simulated generation,
  each against a discrete-event model of the same draws.
- ``asyncrl version``: the package and wire-protocol versions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import Any

from asyncrl import __version__

BENCHMARKS = ("transport", "runtime")
BENCHMARK_GROUP = "asyncrl.benchmarks"
"""Entry-point group of benchmarks that live outside the runtime (``learner`` and ``pipeline``, in
the roles)."""


def _plugged_benchmarks() -> dict[str, Any]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=BENCHMARK_GROUP)}


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.name == "transport":
        from asyncrl.bench import transport

        return transport.main(rest)
    if args.name == "runtime":
        from asyncrl.bench import runtime

        return runtime.main(rest)
    plugged = _plugged_benchmarks().get(args.name)
    if plugged is not None:
        result: int = plugged.load()(rest)
        return result
    raise AssertionError(args.name)


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.agent import run_manifest, summary
    from asyncrl.manifest import ManifestError, load_manifest, resolve_run_dir
    from asyncrl.transport import run

    try:
        manifest = load_manifest(args.manifest, args.set)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return 2
    run_dir = os.path.abspath(args.run_dir) if args.run_dir else resolve_run_dir(manifest)
    report = run(run_manifest(manifest, run_dir))
    print(summary(report, manifest, run_dir), flush=True)
    return {"completed": 0, "failed": 1, "interrupted": 130}[report.status]


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
    bench.add_argument(
        "name", choices=[*BENCHMARKS, *sorted(_plugged_benchmarks())], help="which benchmark"
    )
    bench.set_defaults(func=_bench)
    run = sub.add_parser("run", help="run a manifest on this machine (the embedded default)")
    run.add_argument("manifest", help="the role manifest (YAML); see docs/manifest.md")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a manifest value, e.g. --set roles.rollout.replicas=4",
    )
    run.add_argument("--run-dir", help="where the run writes (default: the manifest's run_dir)")
    run.set_defaults(func=_run)
    version = sub.add_parser("version", help="print the package and wire-protocol versions")
    version.set_defaults(func=_version)
    args, rest = parser.parse_known_args(argv)
    if rest and args.func is not _bench:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    result: int = args.func(args, rest)
    return result


if __name__ == "__main__":
    sys.exit(main())

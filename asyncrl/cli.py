"""The ``asyncrl`` command line.

- ``asyncrl run MANIFEST [--set KEY=VALUE]... [--run-dir DIR] [--overwrite]``: run a manifest on
  this machine; the resolved manifest is saved as ``RUN_DIR/manifest.json``. A run directory that
  already holds a run is refused unless ``--overwrite`` (start afresh) is given.
- ``asyncrl run ... -v``: print every log line of the run's processes on the console, not only
  the progress, warnings, errors and the final summary table (all are in ``RUN_DIR/logs``).
- ``asyncrl run --resume RUN_DIR``: run the manifest saved in ``RUN_DIR`` again, in ``RUN_DIR``,
  after all its processes were killed: the roles and the program resume from what they kept.
- ``asyncrl chaos MANIFEST [--kill-every 5s] [--roles rollout,reward] [--stop-every D --stop-for D]
  [--seed S] [--from-phase NAME] [--after D] [--json] [--no-baseline] [--set KEY=VALUE]...
  [--run-dir DIR] [--overwrite]``: run a manifest undisturbed, then again while killing and
  freezing replicas (from the program's phase NAME, D after it or after the start), and print an
  accounting.
- ``asyncrl chaos MANIFEST --nodes N --kill-node R --every D [--rejoin-after T] [--losses K]
  [--agent-liveness D] [--join-timeout D] [--from-phase NAME] [--after D] [--json]
  [--no-baseline] ...``: launch the manifest as N torchrun nodes on this machine, undisturbed and
  then losing node R every D (its torchrun, agent and roles SIGKILLed at once), started again T
  after each loss, and print the accounting with the nodes' figures (docs/multinode.md).
- ``asyncrl bench transport [--json] [--quick]``: the transport's figures, side by side.
- ``asyncrl bench runtime [--json] [--kills N]``: crash detection, restart, handle overhead.
- ``asyncrl bench learner [--json]``: a learner step through a handle against plain PyTorch.
- The developers' benchmarks below run from a source checkout (the top-level ``benchmarks/``
  package, outside the wheel); installed from a wheel, ``asyncrl bench`` says where to get them.
- ``asyncrl bench pipeline [--json] [--quick]``: sync against async mode on simulated generation,
  each against a discrete-event model of the same draws.
- ``asyncrl bench scale [--json] [--quick] [--shards K] [--rounds R]``: the driver against 1 to
  256 simulated rollout replicas: samples/s, driver CPU per sample, dispatch latency, memory;
  with ``--shards``, each row also with K dispatch shards, R rounds (3) alternating the arms'
  order, medians (docs/scaling.md).
- ``asyncrl bench multinode [--json]``: weight sync on one host against across two simulated
  hosts, the shortened main job on one node against two, one learner against two data-parallel.
- ``asyncrl bench sharding [--json] [--ranks 1,2]``: peak memory per rank and step time of an
  FSDP-sharded learner against one unsharded rank, on a 302M-parameter Qwen2.
- ``asyncrl bench durability [--json] [--small] [--k K]``: a learner step with ``durable: false``,
  ``wal`` and ``checkpoint`` on a 303M-parameter Qwen2, interleaved; a write-ahead-logged learner
  SIGKILLed K steps past its checkpoint: time to serve again, steps replayed, weights bit-identical.
- ``asyncrl bench elastic [--json] [--small]``: a sharded learner's state carried from 2 ranks
  onto 1 and back (a node's loss and return) on a 303M-parameter Qwen2: start, load and
  resharding seconds against a same-size restore, and the weights' parity.
- ``asyncrl bench episodes [--json] [--quick] [--replicas 1,2,4,8]``: multi-turn episodes/s
  against the number of environment replicas, sync batches against episodes always in flight,
  with environment step latency spread log-normally (sigma 1.0), and the rollout's idle fraction.
- ``asyncrl plot RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG figures of the runs' per-step metrics
  (reward, accuracy, throughput, staleness, time), several runs on one figure; in the first
  run's ``plots/`` unless ``--out`` (``asyncrl.observe.plots``; matplotlib is the ``plot`` extra).
- ``asyncrl run --trace ...``: also record every call between processes and the spans inside
  roles into ``RUN_DIR/trace.json`` (``asyncrl.observe.trace``); ``asyncrl trace view RUN_DIR``
  writes ``RUN_DIR/trace.html``, the control-flow graph and who waited on whom
  (``asyncrl.observe.trace_view``).
- ``asyncrl status RUN_DIR [--json] [--timeout S]``: ask a running run what it is doing: every
  process with its incarnation, restarts and last heartbeat, each replica's credit and queue,
  the step and version, on every node (``asyncrl.observe.status``, docs/status.md).
- ``asyncrl keys generate DIR [--force]``: the Curve key pairs of a run across hosts
  (``asyncrl.keys``), to copy to every node and name in the manifest's ``security.curve_keys``.
- ``asyncrl clean``: remove what runs on this machine whose agent and janitor are both gone (a
  cgroup kill) left behind: their shared-memory segments and socket files; those of live runs
  are kept. ``asyncrl run`` does the same before it starts (``asyncrl.supervision.janitor``).
- ``asyncrl version``: the package and wire-protocol versions.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from typing import Any

from asyncrl import __version__

BENCHMARKS = ("transport", "runtime", "learner")
"""The benchmarks the wheel ships, user-facing checks: each the module of that name in
``asyncrl.bench``."""
DEVELOPER_BENCHMARKS = (
    "pipeline",
    "scale",
    "multinode",
    "sharding",
    "durability",
    "elastic",
    "episodes",
    "learning",
)
"""The developers' benchmarks (simulators, the pipeline's model, the sharding and durability
benches): each the module of that name in the top-level ``benchmarks`` package of a source
checkout, outside the wheel."""
BENCHMARK_GROUP = "asyncrl.benchmarks"
"""Entry-point group of benchmarks that other installed packages add (a name and a
``main(argv) -> int``); a built-in name takes precedence."""


def _plugged_benchmarks() -> dict[str, Any]:
    plugged = importlib.metadata.entry_points(group=BENCHMARK_GROUP)
    builtin = (*BENCHMARKS, *DEVELOPER_BENCHMARKS)
    return {ep.name: ep for ep in plugged if ep.name not in builtin}


def _developer_benchmark(name: str) -> Any:
    """The module ``benchmarks.<name>`` of the source checkout this asyncrl runs from (an
    editable install, or the checkout on ``sys.path``), or ``None`` after saying where to get
    it."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(checkout, "benchmarks", "__init__.py")):
        if checkout not in sys.path:
            sys.path.insert(0, checkout)
        # The roles a benchmark starts (simulated rollouts) are its modules too, in processes
        # that start wherever the run directory is.
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([checkout, *([path] if path else [])])
        return importlib.import_module(f"benchmarks.{name}")
    print(
        f"asyncrl bench {name}: a developer benchmark, kept in the benchmarks/ folder of the "
        "asyncrl source repository and not in the installed package; run it from a checkout "
        f"of the repository, installed in editable mode (pip install -e .): asyncrl bench {name}",
        file=sys.stderr,
    )
    return None


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.name in BENCHMARKS:
        module = importlib.import_module(f"asyncrl.bench.{args.name}")
        result: int = module.main(rest)
        return result
    if args.name in DEVELOPER_BENCHMARKS:
        module = _developer_benchmark(args.name)
        if module is None:
            return 2
        result = module.main(rest)
        return result
    plugged = _plugged_benchmarks().get(args.name)
    if plugged is not None:
        result = plugged.load()(rest)
        return result
    raise AssertionError(args.name)


def _load(path: str, overrides: list[str]) -> Any:
    """The manifest at ``path`` with ``overrides``, or ``None`` after printing its problems."""
    from asyncrl.manifest.load import ManifestError, load_manifest

    try:
        return load_manifest(path, overrides, nodes=1)  # asyncrl.launch takes more nodes
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return None


def _fail(message: str) -> int:
    print(f"asyncrl: error: {message}", file=sys.stderr)
    return 2


def _sweep_dead_runs() -> list[str] | None:
    """Remove the leftovers of runs whose agent and janitor are gone; say so on stderr.
    ``None``: no lease folder could be trusted, nothing was swept (a warning says why)."""
    from asyncrl.supervision.janitor import sweep_dead_runs
    from asyncrl.supervision.leases import LeaseDirError

    try:
        removed = sweep_dead_runs()
    except LeaseDirError as exc:
        print(
            f"asyncrl: warning: not sweeping what killed runs left behind: {exc}",
            file=sys.stderr,
        )
        return None
    if removed:
        print(
            f"asyncrl: removed {len(removed)} leftovers of runs that are no longer alive "
            f"(shared-memory segments, socket files): {' '.join(removed)}",
            file=sys.stderr,
        )
    return removed


def _clean(args: argparse.Namespace, rest: list[str]) -> int:
    removed = _sweep_dead_runs()
    if removed is None:
        return 1
    if not removed:
        print("asyncrl: nothing to clean: no run left anything behind", file=sys.stderr)
    return 0


def _claim(
    run_dir: str, overwrite: bool, *, resume_hint: bool = True, allow_nonempty: bool = False
) -> str | None:
    """Make ``run_dir`` ready for a new run (``asyncrl.supervision.rundir.prepare_run_dir``):
    ``None``, or why it cannot be used."""
    from asyncrl.supervision.rundir import RunDirError, prepare_run_dir

    hint = f"use 'asyncrl run --resume {run_dir}' to continue it or " if resume_hint else ""
    try:
        prepare_run_dir(
            run_dir, overwrite=overwrite, continue_hint=hint, allow_nonempty=allow_nonempty
        )
    except (RunDirError, OSError) as exc:
        return str(exc)
    return None


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.manifest.load import ManifestError, resolve_run_dir
    from asyncrl.observe.logs import VERBOSE_ENV
    from asyncrl.supervision.agent import run_manifest, summary
    from asyncrl.supervision.rundir import (
        MANIFEST_FILE,
        PRIVATE_UMASK,
        RunDirError,
        load_saved_manifest,
        manifest_differences,
        prepare_run_dir,
        save_manifest,
    )
    from asyncrl.transport import run

    if args.resume:
        run_dir = os.path.abspath(args.resume)
        if args.overwrite:
            return _fail("--resume continues a run and --overwrite deletes it; give one of them")
        if args.set:
            return _fail(
                f"--set cannot change a resumed run; it runs the manifest saved in "
                f"{os.path.join(run_dir, MANIFEST_FILE)} (edit that file to change it)"
            )
        if args.run_dir and os.path.abspath(args.run_dir) != run_dir:
            return _fail(f"--run-dir {args.run_dir} differs from --resume {args.resume}; drop it")
        try:
            manifest = load_saved_manifest(run_dir)
        except RunDirError as exc:
            return _fail(str(exc))
        except ManifestError as exc:
            print(exc, file=sys.stderr)
            return 2
        if args.manifest:
            given = _load(args.manifest, [])
            if given is None:
                return 2
            differences = manifest_differences(manifest, given)
            if differences:
                return _fail(
                    f"{args.manifest} differs from the manifest {run_dir} was started with "
                    f"(at {', '.join(differences)}); a resumed run keeps its manifest: drop "
                    "MANIFEST, or start a new run with --overwrite"
                )
        os.umask(PRIVATE_UMASK)  # whatever the run creates is private (docs/reliability.md)
        try:  # private, marked, even when an earlier version started it; not if in use
            prepare_run_dir(run_dir, resume=True)
        except (RunDirError, OSError) as exc:
            return _fail(str(exc))
    else:
        if not args.manifest:
            return _fail("give a MANIFEST to run, or --resume RUN_DIR to continue a run")
        manifest = _load(args.manifest, args.set)
        if manifest is None:
            return 2
        run_dir = os.path.abspath(args.run_dir) if args.run_dir else resolve_run_dir(manifest)
        os.umask(PRIVATE_UMASK)  # whatever the run creates is private (docs/reliability.md)
        problem = _claim(run_dir, args.overwrite, allow_nonempty=args.allow_nonempty)
        if problem:
            return _fail(problem)
        try:
            save_manifest(manifest, run_dir)
        except RunDirError as exc:
            return _fail(str(exc))
    if args.verbose:  # the run's processes inherit it (asyncrl.observe.logs)
        os.environ[VERBOSE_ENV] = "1"
    _sweep_dead_runs()
    if args.trace:
        from asyncrl.observe.trace import enable, merge_and_tell

        enable(run_dir)
    try:
        report = run(run_manifest(manifest, run_dir))
    except ManifestError as exc:  # e.g. a resumed multi-node manifest: asyncrl.launch runs it
        print(exc, file=sys.stderr)
        return 2
    print(summary(report, manifest, run_dir), flush=True)
    if args.trace:
        merge_and_tell(run_dir)
    return {"completed": 0, "failed": 1, "interrupted": 130}[report.status]


def _claim_chaos_dirs(args: argparse.Namespace, manifest: Any) -> tuple[str, str]:
    """A chaos campaign's run directory (``--run-dir``, or the manifest's with ``-chaos``), and
    why its ``undisturbed`` and ``chaos`` folders cannot be used ("" when they can)."""
    from asyncrl.manifest.load import resolve_run_dir

    run_dir = (
        os.path.abspath(args.run_dir) if args.run_dir else resolve_run_dir(manifest) + "-chaos"
    )
    parts = ["chaos"] if args.no_baseline else ["undisturbed", "chaos"]
    for part in parts:
        problem = _claim(os.path.join(run_dir, part), args.overwrite, resume_hint=False)
        if problem:
            return run_dir, problem
    return run_dir, ""


def _chaos(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.chaos.campaign import (
        NODES_ONLY,
        ChaosPlan,
        budget_overrides,
        budgets,
        check_roles,
        run_chaos,
    )
    from asyncrl.supervision.rundir import PRIVATE_UMASK

    if args.nodes is not None:
        return _chaos_nodes(args)
    given = [flag for flag in NODES_ONLY if _given(args, flag)]
    if given:
        return _fail(
            f"{given[0]} loses a node of a launch over several: give --nodes N with it (and "
            "--kill-node R --every D), or leave it out to kill processes on one machine"
        )
    kill_every = 5.0 if args.kill_every is None else (args.kill_every or None)
    if args.stop_every is None and kill_every is None:
        return _fail("nothing to do: give --kill-every or --stop-every")
    plain = _load(args.manifest, args.set)
    if plain is None:
        return 2
    try:
        wanted = args.roles.split(",") if args.roles is not None else [*plain.roles, "driver"]
        roles = check_roles(plain, wanted)
    except ValueError as exc:
        return _fail(str(exc))
    plan = ChaosPlan(
        roles=tuple(roles),
        kill_every=kill_every,
        stop_every=args.stop_every,
        stop_for=5.0 if args.stop_for is None else args.stop_for,
        seed=args.seed or 0,
        from_phase=args.from_phase,
        after=args.after,
    )
    # The chaos budgets first, so that the user's own --set, after them, wins.
    manifest = _load(args.manifest, [*budget_overrides(plain, plan), *args.set])
    if manifest is None:
        return 2
    every = f"SIGKILL every {kill_every:g} s" if kill_every else "no SIGKILL"
    if args.stop_every:
        every += f", SIGSTOP for {plan.stop_for:g} s every {args.stop_every:g} s"
    if args.from_phase:
        every += f", from the start of phase {args.from_phase}"
    if args.after:
        every += f", {args.after:g} s after {'it' if args.from_phase else 'the start'}"
    print(f"chaos: {every}, among the replicas of {', '.join(roles)}", file=sys.stderr)
    print("restart budgets for the chaos run:", file=sys.stderr)
    for role, budget in budgets(manifest, plan.roles).items():
        print(
            f"  {role}: {budget['max_restarts']} restarts in {budget['period_s']:g} s, "
            f"backoff {budget['backoff_initial_s']:g} s doubling to {budget['backoff_max_s']:g} s",
            file=sys.stderr,
        )
    run_dir, problem = _claim_chaos_dirs(args, manifest)
    if problem:
        return _fail(problem)
    os.umask(PRIVATE_UMASK)  # whatever the runs create is private (docs/reliability.md)
    return run_chaos(manifest, run_dir, plan, baseline=not args.no_baseline, as_json=args.json)


def _given(args: argparse.Namespace, flag: str) -> bool:
    """Whether ``flag`` (an option of ``asyncrl chaos`` whose default is ``None``) was given."""
    return getattr(args, flag.removeprefix("--").replace("-", "_")) is not None


def _at_most(losses: int | None) -> str:
    if losses is None:
        return ""
    return ", once" if losses == 1 else f", at most {losses} times"


def _chaos_nodes(args: argparse.Namespace) -> int:
    """``asyncrl chaos MANIFEST --nodes N --kill-node K --every D [--rejoin-after T]``: lose
    node K of a launch over N local torchrun nodes on a schedule (``asyncrl.chaos.nodes``)."""
    from asyncrl.chaos.campaign import ONE_MACHINE_ONLY
    from asyncrl.chaos.nodes import NodePlan, check_node_plan, run_node_chaos
    from asyncrl.manifest.load import ManifestError, load_manifest
    from asyncrl.manifest.membership import node_loss_warnings
    from asyncrl.supervision.rundir import PRIVATE_UMASK

    other = [flag for flag in ONE_MACHINE_ONLY if _given(args, flag)]
    if other:
        return _fail(
            f"{other[0]} kills processes on one machine; with --nodes the campaign loses "
            "whole nodes (--kill-node R --every D [--rejoin-after T]): leave out "
            f"{', '.join(other)}, or --nodes"
        )
    for flag, fix in (
        ("--kill-node", "R, the node to lose (1 to N-1)"),
        ("--every", "D, how often to lose it (e.g. 60s)"),
    ):
        if not _given(args, flag):
            return _fail(f"--nodes needs {flag} {fix}")
    plan = NodePlan(
        nodes=args.nodes,
        kill_node=args.kill_node,
        every=args.every,
        rejoin_after=args.rejoin_after,
        losses=args.losses,
        from_phase=args.from_phase,
        after=args.after,
        agent_liveness=15.0 if args.agent_liveness is None else args.agent_liveness,
        join_timeout=300.0 if args.join_timeout is None else args.join_timeout,
    )
    try:
        check_node_plan(plan)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        manifest = load_manifest(args.manifest, args.set, nodes=plan.nodes)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return 2
    for warning in node_loss_warnings(manifest, plan.nodes):
        print(f"asyncrl: warning: {warning}", file=sys.stderr)
    rejoin = (
        f", started again {plan.rejoin_after:g} s after each loss"
        if plan.rejoin_after is not None
        else ", never started again"
    )
    aim = f" from the start of phase {plan.from_phase}" if plan.from_phase else ""
    if plan.after:
        aim += f", {plan.after:g} s after {'it' if plan.from_phase else 'the start'}"
    print(
        f"chaos: {plan.nodes} nodes; node {plan.kill_node} lost every {plan.every:g} s{aim}"
        f"{rejoin}{_at_most(plan.losses)} (agent liveness "
        f"{plan.agent_liveness:g} s)",
        file=sys.stderr,
    )
    run_dir, problem = _claim_chaos_dirs(args, manifest)
    if problem:
        return _fail(problem)
    os.umask(PRIVATE_UMASK)  # whatever the runs create is private (docs/reliability.md)
    return run_node_chaos(
        os.path.abspath(args.manifest),
        list(args.set),
        run_dir,
        plan,
        baseline=not args.no_baseline,
        as_json=args.json,
    )


def _plot(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.observe.plots import plot_runs

    try:
        written = plot_runs(args.run_dirs, args.out)
    except (OSError, ValueError, ImportError) as exc:
        return _fail(str(exc))
    for path in written:
        print(path)
    return 0


def _trace(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.errors import AsyncrlError
    from asyncrl.observe.trace_view import write_page

    try:
        print(write_page(args.run_dir, infrastructure=args.infrastructure))
    except AsyncrlError as exc:
        return _fail(str(exc))
    return 0


def _keys(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.errors import AsyncrlError
    from asyncrl.keys import generate

    try:
        written = generate(args.directory, force=args.force)
    except AsyncrlError as exc:
        return _fail(str(exc))
    directory = os.path.dirname(written[0])
    for path in written:
        print(f"wrote {path}")
    print(
        f"Copy {directory} to the same path on every node of the run, keeping the secret files "
        f"private (rsync -a {directory}/ NODE:{directory}/), and name it in the manifest:\n"
        f"  security:\n    curve_keys: {directory}"
    )
    return 0


def _version(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.transport.protocol import PROTOCOL_VERSION

    print(f"asyncrl {__version__} (wire protocol {PROTOCOL_VERSION})")
    return 0


def _run_dir_options(
    parser: argparse.ArgumentParser, default: str = "the manifest's run_dir", nonempty: bool = False
) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a manifest value, e.g. --set roles.rollout.replicas=4",
    )
    parser.add_argument("--run-dir", help=f"where the run writes (default: {default})")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete what an earlier run left in the run directory and start afresh",
    )
    if nonempty:
        parser.add_argument(
            "--allow-nonempty",
            action="store_true",
            help="start a first run in a folder that holds other files (they are never removed)",
        )


def _status(args: argparse.Namespace, rest: list[str]) -> int:
    from asyncrl.observe.status import main as status_main

    return status_main(rest)


def _selfcheck(args: argparse.Namespace, rest: list[str]) -> int:
    """``asyncrl selfcheck [--plugin NAME] [--json] [--layers ...]``, reached by module name:
    the runtime imports no plugin module (docs/plugins.md)."""
    selfcheck: Any = importlib.import_module("asyncrl.plugins.selfcheck")
    return int(selfcheck.main(rest))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``asyncrl`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="An asynchronous actor-model runtime for RL post-training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser("bench", help="run a benchmark and print its figures", add_help=False)
    bench.add_argument(
        "name",
        choices=[*BENCHMARKS, *DEVELOPER_BENCHMARKS, *sorted(_plugged_benchmarks())],
        help="which benchmark",
    )
    bench.set_defaults(func=_bench)
    run = sub.add_parser("run", help="run a manifest on this machine (the embedded default)")
    run.add_argument("manifest", nargs="?", help="the role manifest (YAML); see docs/manifest.md")
    _run_dir_options(run, nonempty=True)
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR with the manifest saved there (MANIFEST, if given, "
        "must be the same)",
    )
    run.add_argument(
        "--trace", action="store_true", help="record every call as RUN_DIR/trace.json (Perfetto)"
    )
    run.add_argument("-v", "--verbose", action="store_true", help="every log line on the console")
    run.set_defaults(func=_run)
    chaos = sub.add_parser(
        "chaos", help="run a manifest while killing its processes, and account for the damage"
    )
    chaos.add_argument("manifest", help="the role manifest (YAML); see docs/manifest.md")
    _run_dir_options(chaos, default="the manifest's run_dir + '-chaos'")
    from asyncrl.chaos.campaign import add_arguments

    add_arguments(chaos)
    chaos.set_defaults(func=_chaos)
    plot = sub.add_parser(
        "plot", help="draw runs' metrics (reward, accuracy, throughput, staleness) as PNGs"
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runs to draw, together")
    plot.add_argument("--out", metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots)")
    plot.set_defaults(func=_plot)
    trace = sub.add_parser("trace", help="look at a traced run (asyncrl run --trace)")
    view = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    page = view.add_parser("view", help="write RUN_DIR/trace.html: the control-flow graph")
    page.add_argument("run_dir", metavar="RUN_DIR", help="a run made with asyncrl run --trace")
    page.add_argument(
        "--infrastructure",
        action="store_true",
        help="draw the node agent in the graph too (lighter); the timeline and table show it",
    )
    page.set_defaults(func=_trace)
    status = sub.add_parser(
        "status", help="ask a running run what it is doing (docs/status.md)", add_help=False
    )
    status.set_defaults(func=_status)
    keys = sub.add_parser("keys", help="Curve keys for runs across hosts")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    generate = keys_sub.add_parser(
        "generate", help="write a run's server and client key pairs into DIR (0700, secrets 0600)"
    )
    generate.add_argument("directory", metavar="DIR", help="where the key files go")
    generate.add_argument("--force", action="store_true", help="replace keys already in DIR")
    generate.set_defaults(func=_keys)
    selfcheck = sub.add_parser(
        "selfcheck", help="check a hardware plugin layer by layer (docs/plugins.md)", add_help=False
    )
    selfcheck.set_defaults(func=_selfcheck)
    clean = sub.add_parser(
        "clean", help="remove the shared memory and sockets that killed runs left behind"
    )
    clean.set_defaults(func=_clean)
    version = sub.add_parser("version", help="print the package and wire-protocol versions")
    version.set_defaults(func=_version)
    args, rest = parser.parse_known_args(argv)
    if rest and args.func not in (_bench, _status, _selfcheck):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    result: int = args.func(args, rest)
    return result


if __name__ == "__main__":
    sys.exit(main())

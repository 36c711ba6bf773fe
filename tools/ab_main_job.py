"""Interleaved A/B of the README's main job between two commits: same work, same noise.

    .venv/bin/python tools/ab_main_job.py BASE [HEAD] [--pairs 3] [--set KEY=VALUE]...

Each commit is built once into its own folder (``pip install --no-deps --target``) with this
venv's packages, and runs from a copy of its own ``examples/``; the runs alternate base, head,
base, head, ... so both sides see the same load. Each run is timed by ``/usr/bin/time``: wall
seconds and CPU seconds (user + system of the run and every process it waited for). CPU seconds
are what a shared, noisy machine measures best; wall seconds are printed too. It prints each
run, then the medians and the head/base ratios, and fails when a run fails or when the two sides
did different work (their final ``learner_steps`` differ).

Used to check that a change leaves the main job's speed alone (e.g. roles taking their hardware
from the plugin registry: docs/plugins.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "examples/arith/bc_grpo.yaml"


def build(rev: str, into: str) -> str:
    """Build commit ``rev`` into ``into``/pkg and copy its examples to ``into``/work."""
    tree = os.path.join(into, "tree")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, rev], check=True)
    try:
        pkg = os.path.join(into, "pkg")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        subprocess.run([*pip, "--target", pkg, tree], check=True)
        shutil.copytree(os.path.join(tree, "examples"), os.path.join(into, "work", "examples"))
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=True)
    return pkg


def run_once(side: str, folder: str, run_dir: str, sets: list[str]) -> dict[str, float]:
    """One main job of ``side``; its wall and CPU seconds and learner steps."""
    times = os.path.join(folder, "time.txt")
    env = dict(os.environ, PYTHONPATH=os.path.join(folder, "pkg"))
    command = [
        "/usr/bin/time",
        "-f",
        "%e %U %S",
        "-o",
        times,
        sys.executable,
        "-m",
        "asyncrl.cli",
        "run",
        MANIFEST,
        "--run-dir",
        run_dir,
        "--overwrite",
        *[a for s in sets for a in ("--set", s)],
    ]
    done = subprocess.run(
        command, cwd=os.path.join(folder, "work"), env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"{side}: the run failed ({done.returncode}):\n{done.stdout[-2000:]}")
    with open(times) as f:
        wall, user, system = (float(x) for x in f.read().split()[-3:])
    result = [line for line in done.stdout.splitlines() if line.startswith("result: ")]
    steps = json.loads(result[-1].removeprefix("result: "))["learner_steps"] if result else -1
    return {"wall": wall, "cpu": user + system, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", help="the commit to compare against")
    parser.add_argument("head", nargs="?", default="HEAD", help="the commit measured (HEAD)")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side (3)")
    parser.add_argument("--set", action="append", default=[], help="a manifest override")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="asyncrl-ab-") as tmp:
        folders = {side: os.path.join(tmp, side) for side in ("base", "head")}
        for side, rev in (("base", args.base), ("head", args.head)):
            build(rev, folders[side])
        got: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
        for i in range(args.pairs):
            for side in ("base", "head"):
                run_dir = os.path.join(folders[side], f"run-{i}")
                got[side].append(run_once(side, folders[side], run_dir, args.set))
                r = got[side][-1]
                print(
                    f"{side} {i + 1}: wall {r['wall']:.1f} s, cpu {r['cpu']:.1f} s, "
                    f"learner steps {r['steps']:.0f}",
                    flush=True,
                )
    steps = {r["steps"] for side in got.values() for r in side}
    if len(steps) != 1:
        sys.exit(f"the two sides did different work: learner steps {sorted(steps)}")
    for key in ("cpu", "wall"):
        base = statistics.median(r[key] for r in got["base"])
        head = statistics.median(r[key] for r in got["head"])
        pairs = [h[key] / b[key] for b, h in zip(got["base"], got["head"], strict=True)]
        print(
            f"{key}: base median {base:.1f} s, head median {head:.1f} s, head/base "
            f"{head / base:.3f} (per pair {', '.join(f'{p:.3f}' for p in pairs)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run mypy on the package as it imports (asyncrl and its mapped layers), and on the developers'
benchmarks beside it.

The layers sit at the top of the repository and are mapped into ``asyncrl`` by setuptools'
package-dir, which mypy cannot follow through an editable install, and no mypy option maps a
package name to another folder. So this builds a tree of symbolic links under build/typecheck
that has the installed shape, and checks that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {"transport": "transport", "roles": "roles", "plugins": "plugins"}


def build_tree() -> str:
    # One tree per run: two checks running at once must not pull the tree from under each other.
    tree = os.path.join(ROOT, "build", f"typecheck-{os.getpid()}")
    shutil.rmtree(tree, ignore_errors=True)
    pkg = os.path.join(tree, "asyncrl")
    os.makedirs(pkg)
    for entry in os.listdir(os.path.join(ROOT, "asyncrl")):
        if entry != "__pycache__":
            os.symlink(os.path.join(ROOT, "asyncrl", entry), os.path.join(pkg, entry))
    for name, folder in LAYERS.items():
        os.symlink(os.path.join(ROOT, folder), os.path.join(pkg, name))
    os.symlink(os.path.join(ROOT, "benchmarks"), os.path.join(tree, "benchmarks"))
    return tree


def main() -> int:
    tree = build_tree()
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        os.path.join(ROOT, "pyproject.toml"),
        "-p",
        "asyncrl",
        "-p",
        "benchmarks",
        *sys.argv[1:],
    ]
    try:
        return subprocess.call(cmd, cwd=tree, env={**os.environ, "MYPYPATH": tree})
    finally:
        shutil.rmtree(tree, ignore_errors=True)  # with its cache: ~110 MB a run otherwise kept


if __name__ == "__main__":
    sys.exit(main())

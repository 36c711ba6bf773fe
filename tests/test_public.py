"""The public surface of ``asyncrl``: ``__all__`` is exactly what the package offers, and every
name in it imports, from the module that defines it, without making ``import asyncrl`` dear."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import asyncrl
import asyncrl.errors


def _public_names(module: types.ModuleType) -> set[str]:
    """The names a user reaches on ``module``: not private, not a submodule or an import."""
    return {
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    }


def test_all_is_the_public_surface() -> None:
    names = asyncrl.__all__
    assert len(names) == len(set(names))
    assert _public_names(asyncrl) == set(names) - {"__version__"}
    assert asyncrl.__version__ == "0.1.0" and "__version__" in names


def test_the_surface_has_what_a_user_needs() -> None:
    needed = {"Role", "RoleContext", "endpoint", "Delivery", "Context", "Handle"}
    needed |= {"Manifest", "load_manifest", "run_manifest"}
    needed |= {"Ledger"}  # what a consuming role counts each result once with
    needed |= set(asyncrl.errors.__all__)  # every error class of the one hierarchy
    assert needed == set(asyncrl.__all__) - {"__version__"}


@pytest.mark.parametrize("name", sorted(set(asyncrl.__all__) - {"__version__"}))
def test_each_name_imports_from_its_home(name: str) -> None:
    value = getattr(asyncrl, name)
    home = importlib.import_module(value.__module__)
    assert getattr(home, name) is value
    assert name in home.__all__
    namespace: dict[str, object] = {}
    exec(f"from asyncrl import {name}", namespace)
    assert namespace[name] is value


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError) as info:
        asyncrl.Nothing  # noqa: B018
    assert str(info.value) == "module 'asyncrl' has no attribute 'Nothing'"
    with pytest.raises(ImportError):
        exec("from asyncrl import Nothing", {})


def test_the_surface_imports_nothing_dear_until_a_name_is_used() -> None:
    code = (
        "import sys, asyncrl; before = 'torch' in sys.modules or 'zmq' in sys.modules;"
        "from asyncrl import *; print(before, sum(n in globals() for n in asyncrl.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", str(len(asyncrl.__all__))]


def test_the_program_face_exports_what_a_program_uses() -> None:
    """``asyncrl.rl`` gathers the names a program uses, each the object of the module that
    defines it, and nothing else."""
    import asyncrl.rl as rl

    assert _public_names(rl) - {"annotations"} == set(rl.__all__)  # __future__ leaves it
    needed = {"Run", "RLLoop", "Evaluation", "SamplingParams", "Prompt", "Sample", "TrainBatch"}
    assert needed <= set(rl.__all__)
    for name in rl.__all__:
        value = getattr(rl, name)
        home = importlib.import_module(value.__module__)
        assert getattr(home, name) is value, name


def test_a_grpo_program_on_reasoning_gym_fits_25_lines_from_asyncrl_rl_alone() -> None:
    """The program face's promise, on the example that keeps it: GRPO on a reasoning-gym task
    in at most 25 lines of code (no docstring, comment or blank line), with every asyncrl name
    from ``asyncrl.rl``."""
    import ast

    from tests.conftest import ROOT

    with open(f"{ROOT}/examples/reasoning_gym/program.py") as f:
        source = f.read()
    tree = ast.parse(source)
    assert isinstance(tree.body[0], ast.Expr)  # the module's docstring
    code = [
        line
        for line in source.splitlines()[tree.body[0].end_lineno or 0 :]
        if line.strip() and not line.strip().startswith("#")
    ]
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncrl")
    }
    plain = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert len(code) <= 25, "\n".join(code)
    assert imported == {"asyncrl.rl"} and not [n for n in plain if n.startswith("asyncrl")]
    assert "grpo" in {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }

"""The package layout: import paths, the dependency arrows of docs/architecture.md, the public
surface."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {"transport": "asyncrl.transport", "roles": "asyncrl.roles", "plugins": "asyncrl.plugins"}


def _python_files(folder: str, root: str = ROOT) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(out)


def _imports(path: str, root: str = ROOT) -> set[str]:
    """Absolute module names imported by a file (relative imports resolved to their layer)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    rel = os.path.relpath(path, root).split(os.sep)
    package = LAYERS.get(rel[0], rel[0])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.add(package + ("." + node.module if node.module else ""))
            elif node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _violations(
    folder: str,
    forbidden: tuple[str, ...],
    allowed: tuple[str, ...] = (),
    *,
    skip: tuple[str, ...] = (),
    root: str = ROOT,
) -> list[str]:
    """Each import of a module under ``forbidden`` (and not under ``allowed``) by a file in
    ``folder`` of the tree at ``root``, the files ``skip`` names and those under the folders it
    names left out."""
    bad = []
    for path in _python_files(folder, root):
        rel = os.path.relpath(path, root)
        if rel in skip or rel.startswith(tuple(os.path.join(s, "") for s in skip)):
            continue
        for name in sorted(_imports(path, root)):
            if name.startswith(forbidden) and not name.startswith(allowed):
                bad.append(f"{rel} imports {name}")
    return bad


def test_layers_import_under_asyncrl() -> None:
    for folder, module in LAYERS.items():
        mod = importlib.import_module(module)
        assert mod.__file__ == os.path.join(ROOT, folder, "__init__.py")
    assert importlib.import_module("asyncrl").__file__ == os.path.join(
        ROOT, "asyncrl", "__init__.py"
    )


def test_transport_knows_nothing_of_runtime_roles_or_plugins() -> None:
    assert _violations("transport", ("asyncrl",), ("asyncrl.transport",)) == []


def test_transport_uses_torch_only_in_the_codec() -> None:
    users = [
        os.path.basename(p)
        for p in _python_files("transport")
        if any(n == "torch" or n.startswith("torch.") for n in _imports(p))
    ]
    assert users == ["codec.py"]


def test_runtime_imports_no_roles_and_no_plugin_module() -> None:
    """The benchmarks (``asyncrl/bench``) may import everything; the rest of the runtime may not,
    but for ``asyncrl/rl.py``, the program's public face, which gathers the roles' names a
    program uses and is imported by programs alone (no part of asyncrl imports it)."""
    skip = (os.path.join("asyncrl", "bench"), FACE)
    assert _violations("asyncrl", ("asyncrl.roles", "asyncrl.plugins"), skip=skip) == []
    face = ("asyncrl.rl",)
    for folder in ("asyncrl", "transport", "roles", "plugins"):
        assert _violations(folder, face) == [], folder


CORE = "core"
"""The modules directly under ``asyncrl/`` (errors, the role base class, safe files ...): every
part may import them, and they import no part. ``asyncrl/__init__.py``, ``cli.py`` and
``launch.py`` are entry points and may import anything."""

ENTRY_POINTS = ("__init__.py", "cli.py", "launch.py", "rl.py")
FACE = os.path.join("asyncrl", "rl.py")
"""The program's public face: it gathers the roles' names a program uses."""

PARTS: dict[str, tuple[str, ...]] = {
    "asyncrl.manifest": (CORE,),
    "asyncrl.observe": (CORE,),
    "asyncrl.weights": (CORE,),
    "asyncrl.dispatch": (CORE, "asyncrl.manifest", "asyncrl.observe"),
    "asyncrl.supervision": (CORE, "asyncrl.manifest", "asyncrl.observe", "asyncrl.dispatch"),
    "asyncrl.chaos": (
        CORE,
        "asyncrl.manifest",
        "asyncrl.observe",
        "asyncrl.dispatch",
        "asyncrl.supervision",
    ),
    "asyncrl.roles.learning": ("asyncrl.roles.payloads",),
    "asyncrl.roles.generation": ("asyncrl.roles.payloads", "asyncrl.roles.device_report"),
    "asyncrl.roles.training": (
        "asyncrl.roles.learning",
        "asyncrl.roles.generation",
        "asyncrl.roles.payloads",
        "asyncrl.roles.device_report",
    ),
    "asyncrl.roles.services": (
        "asyncrl.roles.generation",
        "asyncrl.roles.training",
        "asyncrl.roles.payloads",
        "asyncrl.roles.device_report",
    ),
    "asyncrl.roles.sampling": ("asyncrl.roles.learning", "asyncrl.roles.payloads"),
    "asyncrl.roles.program": (
        "asyncrl.roles.learning",
        "asyncrl.roles.generation",
        "asyncrl.roles.training",
        "asyncrl.roles.services",
        "asyncrl.roles.sampling",
        "asyncrl.roles.agents",
        "asyncrl.roles.payloads",
    ),
    "asyncrl.roles.agents": ("asyncrl.roles.payloads",),
    "asyncrl.roles.agents.adapters": (
        "asyncrl.roles.agents",
        "asyncrl.roles.services",
        "asyncrl.roles.payloads",
    ),
    "asyncrl.roles.payloads": (),
    "asyncrl.roles.device_report": (),
}
"""Each part and the parts it may import. The transport and the plugin registry and contract
are below them all; the roles may also import the whole runtime (every part of ``asyncrl``
above), the runtime no role."""

RUNTIME_PARTS = tuple(p for p in PARTS if not p.startswith("asyncrl.roles"))


def _part_of(module: str) -> str | None:
    """The part a module belongs to: the longest key of PARTS it is under, ``core`` for a
    module directly under ``asyncrl``, None for the transport, plugins, benchmarks and
    third-party modules."""
    if module.startswith(("asyncrl.transport", "asyncrl.plugins", "asyncrl.bench")):
        return None
    for part in sorted(PARTS, key=len, reverse=True):
        if module == part or module.startswith(part + "."):
            return part
    if module == "asyncrl.roles":
        return "asyncrl.roles"
    if module.startswith("asyncrl.") and module.count(".") >= 1:
        return CORE
    return None


def _file_module(rel: str) -> str:
    parts = rel[: -len(".py")].split(os.sep)
    if parts[0] in LAYERS:
        parts = LAYERS[parts[0]].split(".") + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _arrow_violations(root: str = ROOT) -> list[str]:
    """Each import that crosses from one part to another the arrows do not allow, and each
    import of another part's private (``_name``) module."""
    bad = []
    for folder in ("asyncrl", "roles"):
        for path in _python_files(folder, root):
            rel = os.path.relpath(path, root)
            if rel.startswith(os.path.join("asyncrl", "bench")) or (
                os.path.dirname(rel) == "asyncrl" and os.path.basename(rel) in ENTRY_POINTS
            ):
                continue
            mine = _part_of(_file_module(rel))
            for name in sorted(_imports(path, root)):
                theirs = _part_of(name)
                if theirs is None or theirs == mine or name in ("asyncrl", "asyncrl.roles"):
                    continue
                if theirs != CORE and any(seg.startswith("_") for seg in name.split(".")[2:]):
                    bad.append(f"{rel} imports the private {name}")
                elif (
                    mine
                    and mine.startswith("asyncrl.roles")
                    and not theirs.startswith("asyncrl.roles")
                ):
                    continue  # a role may use the runtime
                elif theirs not in PARTS.get(mine or "", ()) and not (mine == CORE == theirs):
                    bad.append(f"{rel} ({mine}) imports {name} ({theirs})")
    return bad


def test_parts_import_only_along_their_arrows() -> None:
    assert _arrow_violations() == []


def test_every_asyncrl_module_the_tree_imports_exists() -> None:
    """Nothing keeps an old path alive (no release has shipped one), so every ``asyncrl``
    module that the code, the tests, the examples and the tools import is where it lives."""
    bad = []
    folders = (
        "asyncrl",
        "transport",
        "roles",
        "plugins",
        "benchmarks",
        "tests",
        "examples",
        "tools",
    )
    for folder in folders:
        for path in _python_files(folder):
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    if name.startswith("asyncrl") and not _module_exists(name):
                        bad.append(f"{os.path.relpath(path, ROOT)} imports {name}")
    assert sorted(set(bad)) == []


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_the_arrows_have_no_circle() -> None:
    seen: dict[str, int] = {}

    def visit(part: str) -> None:
        assert seen.get(part) != 1, f"a circle through {part}"
        if seen.get(part) == 2:
            return
        seen[part] = 1
        for other in PARTS.get(part, ()):
            visit(other)
        seen[part] = 2

    for part in PARTS:
        visit(part)


def test_each_part_says_what_it_may_import() -> None:
    """Each part's ``__init__`` states what it owns and what it may import, and names every part
    of the runtime the arrows let it import."""
    for part, allowed in PARTS.items():
        module = importlib.import_module(part)
        doc = module.__doc__ or ""
        if part.count(".") == 2 and not part.endswith(("payloads", "device_report")):
            assert "May import:" in doc, part
            said = doc.split("May import:", 1)[1]
            for other in allowed:
                if other != CORE:
                    assert f"``{other}``" in said, f"{part} does not say it may import {other}"
        elif part in RUNTIME_PARTS:
            assert "May import:" in doc, part
            said = doc.split("May import:", 1)[1]
            assert "core" in said, part
            for other in allowed:
                if other != CORE:
                    assert f"``{other}``" in said, f"{part} does not say it may import {other}"


def test_the_arrow_check_fails_on_planted_imports(tmp_path: pathlib.Path) -> None:
    for folder in ("asyncrl", "roles"):
        shutil.copytree(
            os.path.join(ROOT, folder),
            tmp_path / folder,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    (tmp_path / "asyncrl" / "observe" / "_planted.py").write_text(
        "from asyncrl.dispatch.handles import Handle\n"
    )
    (tmp_path / "asyncrl" / "_planted.py").write_text("import asyncrl.supervision.agent\n")
    (tmp_path / "roles" / "learning" / "_planted.py").write_text(
        "from asyncrl.roles.training.learner import Learner\n"
        "from asyncrl.manifest._schema import join\n"
    )
    assert sorted(_arrow_violations(str(tmp_path))) == [
        "asyncrl/_planted.py (core) imports asyncrl.supervision.agent (asyncrl.supervision)",
        "asyncrl/observe/_planted.py (asyncrl.observe) imports asyncrl.dispatch.handles "
        "(asyncrl.dispatch)",
        "asyncrl/observe/_planted.py (asyncrl.observe) imports asyncrl.dispatch.handles.Handle "
        "(asyncrl.dispatch)",
        "roles/learning/_planted.py (asyncrl.roles.learning) imports "
        "asyncrl.roles.training.learner (asyncrl.roles.training)",
        "roles/learning/_planted.py (asyncrl.roles.learning) imports "
        "asyncrl.roles.training.learner.Learner (asyncrl.roles.training)",
        "roles/learning/_planted.py imports the private asyncrl.manifest._schema",
        "roles/learning/_planted.py imports the private asyncrl.manifest._schema.join",
    ]


def test_old_module_paths_do_not_import() -> None:
    """Modules moved before any release are found only where they live: an old path is an
    ordinary ``ModuleNotFoundError``, and the short torchrun entry ``asyncrl.launch`` imports
    without a warning."""
    code = (
        "import importlib\n"
        "for old in ('asyncrl.roles.learner', 'asyncrl.trace', 'asyncrl.status'):\n"
        "    try:\n"
        "        importlib.import_module(old)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        print(exc.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["asyncrl.roles.learner", "asyncrl.trace", "asyncrl.status"]
    launch = "from asyncrl.launch import LaunchEnv, main, node_dir"
    subprocess.run([sys.executable, "-W", "error", "-c", launch], check=True)


def test_no_layer_imports_the_benchmarks() -> None:
    """Only the command line reaches ``asyncrl.bench`` and the developers' ``benchmarks``, by
    name when a benchmark is asked for; the wheel's benchmarks never import the developers'."""
    benches = ("asyncrl.bench", "benchmarks")
    bad = _violations("asyncrl", benches, skip=(os.path.join("asyncrl", "bench"),))
    bad += _violations(os.path.join("asyncrl", "bench"), ("benchmarks",))
    for folder in ("transport", "roles", "plugins"):
        bad += _violations(folder, benches)
    assert bad == []


def test_the_wheel_leaves_the_developer_benchmarks_out() -> None:
    """``benchmarks/`` is no package of the distribution, and every developer benchmark the
    command line names is a module there, every shipped one a module of ``asyncrl.bench``."""
    from asyncrl import cli

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if p.split(".")[0] == "benchmarks"]
    for name in cli.DEVELOPER_BENCHMARKS:
        assert os.path.isfile(os.path.join(ROOT, "benchmarks", f"{name}.py")), name
    for name in cli.BENCHMARKS:
        assert os.path.isfile(os.path.join(ROOT, "asyncrl", "bench", f"{name}.py")), name


def test_roles_reach_plugins_only_through_registry_and_contract() -> None:
    allowed = ("asyncrl.plugins.registry", "asyncrl.plugins.contract")
    bad = [
        v
        for v in _violations("roles", ("asyncrl.plugins",), allowed)
        if not v.endswith(" asyncrl.plugins")
    ]
    assert bad == []


def test_the_plugin_arrow_fails_on_a_planted_import(tmp_path: pathlib.Path) -> None:
    """A role importing a plugin module (not the registry or the contract) is reported."""
    shutil.copytree(
        os.path.join(ROOT, "roles"),
        tmp_path / "roles",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (tmp_path / "roles" / "_planted.py").write_text(
        "from asyncrl.plugins.cuda import CudaPlugin\n"
        "from asyncrl.plugins.registry import current\n"
        "import asyncrl.plugins.cpu\n"
    )
    allowed = ("asyncrl.plugins.registry", "asyncrl.plugins.contract")
    bad = _violations("roles", ("asyncrl.plugins",), allowed, root=str(tmp_path))
    assert bad == [
        "roles/_planted.py imports asyncrl.plugins.cpu",
        "roles/_planted.py imports asyncrl.plugins.cuda",
        "roles/_planted.py imports asyncrl.plugins.cuda.CudaPlugin",
    ]


HARDWARE_NAMES = ("cuda", "nccl")
"""Names of one vendor's hardware that role code may not spell out: it asks the plugin."""


def _raw_hardware(path: str) -> list[str]:
    """Each use of ``torch.cuda`` or a string literal naming CUDA hardware in ``path``'s code
    (docstrings and comments left out)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in HARDWARE_NAMES:
            found.append(f"{os.path.basename(path)}:{node.lineno} .{node.attr}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and any(name in node.value.lower() for name in HARDWARE_NAMES)
        ):
            found.append(f"{os.path.basename(path)}:{node.lineno} {node.value!r}")
    return sorted(found)


PLUGIN_ROLES = (
    "training/learner.py",
    "services/reference.py",
    "training/critic.py",
    "training/data_parallel.py",
    "training/checkpoints.py",
    "generation/rollout.py",
    "generation/engine.py",
    "generation/engine_rows.py",
    "generation/vllm_engine.py",
)
"""The roles that take their hardware from the plugin registry (issue 13)."""


def test_roles_name_no_vendor_hardware(tmp_path: pathlib.Path) -> None:
    """The learner, reference, critic and rollout engines reach the device only through the
    plugin; the check sees a planted ``torch.cuda`` and a planted ``"nccl"``."""
    bad = [h for f in PLUGIN_ROLES for h in _raw_hardware(os.path.join(ROOT, "roles", f))]
    assert bad == []
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Docs may say cuda."""\nimport torch\nx = torch.cuda.is_available()\ny = "nccl"\n'
    )
    assert _raw_hardware(str(planted)) == ["planted.py:3 .cuda", "planted.py:4 'nccl'"]


EXAMPLE_TESTS = {
    "tests/test_ledger.py",
    "tests/agents/test_agent_example_game.py",
    "tests/agents/failing_env.py",
    "tests/agents/test_agent_tools_example.py",
}
"""Tests that unit-test an example's own code (the hello counter's ledger, the agent example's
game and demonstrations, the tool example's agent and demonstrations) or run it with a failing
replica of its environment: the only files outside ``examples/`` allowed to import it."""


def test_nothing_imports_examples() -> None:
    bad = []
    for folder in ("asyncrl", "transport", "roles", "plugins", "tests"):
        bad += _violations(folder, ("examples",))
    assert [b for b in bad if b.split(" imports ")[0] not in EXAMPLE_TESTS] == []


def test_the_checker_sees_a_forbidden_import(tmp_path: pathlib.Path) -> None:
    """The arrows test must be able to fail: an import planted in a copy of the tree is reported,
    and one under a skipped folder is not."""
    for folder in ("transport", "asyncrl"):
        shutil.copytree(
            os.path.join(ROOT, folder),
            tmp_path / folder,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    (tmp_path / "transport" / "_planted.py").write_text(
        "from asyncrl.roles import anything\nfrom .codec import Codec\n"
    )
    (tmp_path / "asyncrl" / "bench" / "_planted.py").write_text(
        "import asyncrl.roles.generation.rollout\n"
    )
    root = str(tmp_path)
    assert _violations("transport", ("asyncrl",), ("asyncrl.transport",), root=root) == [
        "transport/_planted.py imports asyncrl.roles",
        "transport/_planted.py imports asyncrl.roles.anything",
    ]
    bench = os.path.join("asyncrl", "bench")
    seen = _violations("asyncrl", ("asyncrl.roles",), root=root)
    assert "asyncrl/bench/_planted.py imports asyncrl.roles.generation.rollout" in seen
    assert _violations("asyncrl", ("asyncrl.roles",), skip=(bench, FACE), root=root) == []
    assert not os.path.exists(os.path.join(ROOT, "transport", "_planted.py"))


@pytest.mark.parametrize("module", ["asyncrl.transport", "asyncrl.errors"])
def test_public_names_resolve(module: str) -> None:
    mod = importlib.import_module(module)
    names = mod.__all__
    assert len(names) == len(set(names))
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == []


def test_one_error_hierarchy() -> None:
    """The runtime re-exports the transport's errors and adds its own under the same root."""
    import asyncrl.errors
    import asyncrl.transport.errors

    assert set(asyncrl.transport.errors.__all__) <= set(asyncrl.errors.__all__)
    for name in asyncrl.transport.errors.__all__:
        assert getattr(asyncrl.errors, name) is getattr(asyncrl.transport.errors, name)
    for name in asyncrl.errors.__all__:
        cls = getattr(asyncrl.errors, name)
        assert issubclass(cls, asyncrl.errors.AsyncrlError)
        assert cls.__name__ in asyncrl.errors.__doc__, f"{name} is missing from the drawn tree"


def test_importing_asyncrl_is_cheap() -> None:
    code = "import sys, asyncrl; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_node_agent_imports_no_torch() -> None:
    """The agent supervises; torch and user code load only in the processes it starts."""
    code = (
        "import sys, asyncrl.supervision.agent, asyncrl.supervision.supervisor,"
        "asyncrl.manifest.load, asyncrl.cli;"
        "print('torch' in sys.modules, any(m.startswith('tests.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_transport_imports_torch_only_when_a_tensor_needs_it() -> None:
    """The node agent speaks the transport and must not pay for (or depend on) torch."""
    code = (
        "import sys, asyncrl.transport, asyncrl.errors, asyncrl.cli;print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_stateless_roles_and_the_sample_pipeline_import_no_torch() -> None:
    """The prompt source, the reward role and the driver's pipeline and programs restart
    without paying for a torch import: their payloads live in a torch-free module."""
    code = (
        "import sys, asyncrl.roles.payloads, asyncrl.roles.services.prompts,"
        "asyncrl.roles.services.reward, asyncrl.roles.sampling.pipeline,"
        "asyncrl.roles.program.programs; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regular_install_maps_the_layers() -> None:
    """A regular (non-editable) install puts the layers under asyncrl/ too."""
    with tempfile.TemporaryDirectory(prefix="arl-install-") as target:
        # pip builds in the source tree (build/, *.egg-info): build from a copy, not the repo.
        source = os.path.join(target, "src")
        shutil.copytree(
            ROOT,
            source,
            ignore=shutil.ignore_patterns(
                ".venv*", ".git", "build", "*.egg-info", "*_cache", ".hypothesis", "runs"
            ),
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                os.path.join(target, "site"),
                source,
            ],
            check=True,
            capture_output=True,
        )
        target = os.path.join(target, "site")
        for folder in ("transport", "roles", "plugins"):
            assert os.path.isfile(os.path.join(target, "asyncrl", folder, "__init__.py"))
        code = (
            "import asyncrl.transport, asyncrl.roles, asyncrl.plugins, asyncrl.bench.transport;"
            "print(asyncrl.transport.__file__)"
        )
        env = {**os.environ, "PYTHONPATH": target}
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=target,
            env=env,
        )
        assert out.stdout.strip() == os.path.join(target, "asyncrl", "transport", "__init__.py")
        # Started in a source checkout (python -m, torchrun), a process imports asyncrl from the
        # checkout, ahead of the install: the layers beside it are found. -S keeps this venv's
        # editable install out, so the install and its dependencies are all it has.
        deps = sysconfig.get_paths()["purelib"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([target, deps])}
        out = subprocess.run(
            [sys.executable, "-S", "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=source,
            env=env,
        )
        assert out.stdout.strip() == os.path.join(source, "transport", "__init__.py")


def test_the_size_report_counts_code_and_only_warns(tmp_path: pathlib.Path) -> None:
    """``tools/sizes.py`` counts lines of code (no blank line, comment or docstring), reports a
    module over 600 of them and a function over 80 as warnings, and never fails a commit."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import sizes
    finally:
        sys.path.pop(0)
    source = (
        '"""A module\n\nwith a docstring."""\n'  # lines 1-3: a docstring
        "\n"  # 4: blank
        "# a comment\n"  # 5
        "LIMIT = (\n"  # 6
        "    3  # an argument\n"  # 7
        ")\n"  # 8
        '"""The attribute\'s docstring."""\n'  # 9
        "def f(x):\n"  # 10
        '    """f\'s docstring."""\n'  # 11
        "    return x\n"  # 12
    )
    assert sizes.code_lines(source) == {6, 7, 8, 10, 12}
    body = "".join(f"    y{i} = {i}  # {i}\n\n" for i in range(80))
    assert sizes.long_functions(f'def g():\n    """Doc."""\n{body}') == [(1, "g", 81)]
    shorter = "".join(f"    y{i} = {i}\n" for i in range(79))
    assert sizes.long_functions(f"def g():\n{shorter}") == []
    package = tmp_path / "asyncrl"
    package.mkdir()
    (package / "long.py").write_text('"""Doc."""\n' + "\n".join(f"x{i} = {i}" for i in range(601)))
    (package / "short.py").write_text("\n".join(f"# {i}" for i in range(700)) + "\nx = 1\n")
    assert sizes.findings(str(tmp_path)) == ["asyncrl/long.py: 601 lines of code (over 600)"]
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "sizes.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout
    assert all(line.startswith("warning: ") for line in out.stdout.splitlines()), out.stdout

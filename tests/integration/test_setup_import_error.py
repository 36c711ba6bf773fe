"""An ``ImportError`` raised in a role's ``setup`` is a configuration error: the process exits
with 78 (EX_CONFIG), the supervisor does not restart it, and the run fails once with a message
that names the role, the module and the fix. With a torch companion package installed that does
not load (``torchvision`` from vLLM's CPU build), the fix is the uninstall command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

ROLES = """\
import asyncio

from asyncrl import Delivery, Role, endpoint


async def wait(ctx):
    await asyncio.Event().wait()


class NeedsMissing(Role):
    async def setup(self) -> None:
        import no_such_module_for_asyncrl  # noqa: F401

    @endpoint(Delivery.IDEMPOTENT)
    async def ping(self, _: None) -> int:
        return 1


class NeedsModel(Role):
    async def setup(self) -> None:
        from fakemodels import GPT2LMHeadModel  # noqa: F401

    @endpoint(Delivery.IDEMPOTENT)
    async def ping(self, _: None) -> int:
        return 1
"""

FAKEMODELS = """\
# As transformers does: a model whose requirements do not import is a ModuleNotFoundError
# from the original error.
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        import torchvision  # noqa: F401
    except Exception as exc:
        raise ModuleNotFoundError(f"Could not import module {name!r}") from exc
    raise AttributeError(name)
"""

BROKEN_TORCHVISION = """\
raise RuntimeError("operator torchvision::nms does not exist")
"""

MANIFEST = """\
run:
  name: setupimport
  program: setuproles:wait
roles:
  model:
    class: setuproles:{cls}
    supervision: {{backoff_initial_s: 0.05, max_restarts: 5}}
"""


def _run(  # type: ignore[type-arg]
    tmp: str, cls: str, broken: bool = False, manifest: str = MANIFEST
) -> tuple[int, str, dict]:
    """``asyncrl run`` of the one-role manifest; its exit code, console and report. ``broken``:
    a ``torchvision`` whose import raises is on the path."""
    with open(os.path.join(tmp, "setuproles.py"), "w") as f:
        f.write(ROLES)
    with open(os.path.join(tmp, "fakemodels.py"), "w") as f:
        f.write(FAKEMODELS)
    if broken:
        os.makedirs(os.path.join(tmp, "torchvision"))
        with open(os.path.join(tmp, "torchvision", "__init__.py"), "w") as f:
            f.write(BROKEN_TORCHVISION)
    path = os.path.join(tmp, "manifest.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(manifest.format(cls=cls)))
    run_dir = os.path.join(tmp, "run")
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", path, "--run-dir", run_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{ROOT}"},
        timeout=120,
    )
    with open(os.path.join(run_dir, "report.json")) as f:
        return out.returncode, out.stdout + out.stderr, json.load(f)


def test_a_missing_module_in_setup_fails_the_run_once_without_a_restart(tmp_path: object) -> None:
    code, out, report = _run(str(tmp_path), "NeedsMissing")
    assert code == 1, out
    assert "run failed: model[0] has a configuration error" in out
    failure = report["failure"]
    assert (failure["role"], failure["code"], failure["reason"]) == (
        "model",
        78,
        "configuration error",
    )
    assert report["restarts"]["model"] == 0
    assert [e["role"] for e in report["exits"]] == ["model"]
    [said] = [line for line in failure["stderr_tail"] if line.startswith("configuration error")]
    pid = failure["pid"]
    assert said == (
        f"configuration error: roles.model[0] (pid {pid}) setup could not import module "
        f"'no_such_module_for_asyncrl': ModuleNotFoundError: No module named "
        f"'no_such_module_for_asyncrl'. Install 'no_such_module_for_asyncrl' into the run's "
        f"Python environment ({sys.executable}), or fix the module named in the role's config"
    )
    assert f"| {said}" in out


def test_a_companion_package_that_does_not_load_is_named_with_the_uninstall(
    tmp_path: object,
) -> None:
    """A ``torchvision`` whose import raises (as vLLM's CPU wheels do against the CPU torch)
    makes the model's import fail in setup: the message says to uninstall it."""
    code, out, report = _run(str(tmp_path), "NeedsModel", broken=True)
    assert code == 1, out
    failure = report["failure"]
    assert (failure["code"], report["restarts"]["model"]) == (78, 0)
    [said] = [line for line in failure["stderr_tail"] if line.startswith("configuration error")]
    assert said.startswith(
        f"configuration error: roles.model[0] (pid {failure['pid']}) setup could not import a "
        "module: ModuleNotFoundError: Could not import module 'GPT2LMHeadModel' (caused by "
        "RuntimeError: operator torchvision::nms does not exist). Installed but not loadable "
        "against torch "
    )
    assert said.endswith(
        ": torchvision (RuntimeError: operator torchvision::nms does not exist). vLLM's CPU "
        "build pulls in such wheels, and transformers fails to import its models while they "
        "are installed; asyncrl needs none of them: uninstall them with "
        f"'{sys.executable} -m pip uninstall -y torchvision'"
    )


RAISES_ON_IMPORT = """\
raise RuntimeError("the module's own bug at import")
"""

FINE = """\
import asyncio

from asyncrl import Delivery, Role, endpoint


async def wait(ctx):
    await asyncio.Event().wait()


class Fine(Role):
    @endpoint(Delivery.IDEMPOTENT)
    async def ping(self, _: None) -> int:
        return 1
"""


@pytest.mark.parametrize(
    ("program", "cls", "who", "what"),
    [
        ("fineroles:wait", "raisesonimport:Anything", "model[0]", "'raisesonimport:Anything'"),
        ("raisesonimport:main", "fineroles:Fine", "driver[0]", "run.program"),
    ],
)
def test_a_module_that_raises_while_importing_is_a_configuration_error(
    tmp_path: object, program: str, cls: str, who: str, what: str
) -> None:
    """A role's or the program's module that raises something other than an ``ImportError``
    while it is imported fails the run once with 78, as a missing module does: importing it
    again would raise again, so no restart is spent on it."""
    tmp = str(tmp_path)
    for name, text in (("raisesonimport.py", RAISES_ON_IMPORT), ("fineroles.py", FINE)):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    manifest = MANIFEST.replace("setuproles:wait", program).replace("setuproles:{cls}", cls)
    code, out, report = _run(tmp, "", manifest=manifest)
    assert code == 1, out
    assert f"run failed: {who} has a configuration error" in out
    failure = report["failure"]
    assert (failure["code"], failure["reason"]) == (78, "configuration error")
    assert sum(report["restarts"].values()) == 0
    [said] = [line for line in failure["stderr_tail"] if line.startswith("configuration error")]
    assert what in said, said
    assert "RuntimeError: the module's own bug at import" in said, said

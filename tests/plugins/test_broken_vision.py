"""torch's companion packages installed against another torch (vLLM's CPU build pulls in
``torchvision``, ``torchaudio`` and ``torchcodec`` wheels that do not load against the CPU
torch): ``asyncrl.imports`` finds them, and ``asyncrl selfcheck``'s environment layer fails
naming each and the command that removes them. A package on a temporary ``sys.path`` entry
whose import raises stands for a real broken wheel."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import pytest

from asyncrl.imports import broken_companions, import_problem, uninstall_advice
from asyncrl.plugins import registry, selfcheck

ERROR = "operator torchvision::nms does not exist"


@pytest.fixture
def broken_vision(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``torchvision`` and ``torchaudio`` on the path, both raising on import; a working
    ``torchcodec``."""
    root = str(tmp_path)
    sources = {
        "torchvision": f"raise RuntimeError({ERROR!r})\n",
        "torchaudio": "raise OSError('libtorchaudio.so: undefined symbol: _ZN3c10')\n",
        "torchcodec": "VERSION = 1\n",
    }
    for name, source in sources.items():
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "__init__.py"), "w") as f:
            f.write(source)
    monkeypatch.syspath_prepend(root)
    for name in sources:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield root
    for name in sources:
        sys.modules.pop(name, None)


def test_the_broken_packages_are_found_with_their_errors(broken_vision: str) -> None:
    assert broken_companions() == {
        "torchvision": f"torchvision (RuntimeError: {ERROR})",
        "torchaudio": "torchaudio (OSError: libtorchaudio.so: undefined symbol: _ZN3c10)",
    }


def test_none_is_broken_where_none_is_installed() -> None:
    assert broken_companions() == {}
    assert uninstall_advice({}) == ""


def test_the_advice_names_exactly_what_to_uninstall(broken_vision: str) -> None:
    import torch

    advice = uninstall_advice(broken_companions())
    assert advice == (
        f"Installed but not loadable against torch {torch.__version__}: torchvision "
        f"(RuntimeError: {ERROR}), torchaudio (OSError: libtorchaudio.so: undefined symbol: "
        "_ZN3c10). vLLM's CPU build pulls in such wheels, and transformers fails to import its "
        "models while they are installed; asyncrl needs none of them: uninstall them with "
        f"'{sys.executable} -m pip uninstall -y torchvision torchaudio'"
    )


def test_an_import_error_names_the_module_its_cause_and_the_fix(broken_vision: str) -> None:
    try:
        try:
            import torchvision  # noqa: F401
        except RuntimeError as exc:
            raise ModuleNotFoundError("Could not import module 'GPT2LMHeadModel'") from exc
    except ImportError as exc:
        said = import_problem(exc, "roles.learner[0] (pid 7) setup")
    assert said.startswith(
        "roles.learner[0] (pid 7) setup could not import a module: ModuleNotFoundError: Could "
        f"not import module 'GPT2LMHeadModel' (caused by RuntimeError: {ERROR}). Installed but "
        "not loadable against torch "
    )
    assert said.endswith("-m pip uninstall -y torchvision torchaudio'")


def test_selfcheck_fails_its_environment_layer_and_says_what_to_uninstall(
    broken_vision: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = selfcheck.main(["--plugin", "cpu", "--json", "--layers", "environment"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    [layer] = report["layers"]
    assert (layer["name"], layer["ok"]) == ("environment", False)
    checks = {c["name"]: (c["ok"], c["detail"]) for c in layer["checks"]}
    assert checks["torchvision"] == (False, f"does not import: torchvision (RuntimeError: {ERROR})")
    assert checks["torchaudio"][0] is False
    assert checks["torchcodec"] == (True, "imports")
    ok, detail = checks["uninstall"]
    assert not ok
    assert detail.endswith(f"'{sys.executable} -m pip uninstall -y torchvision torchaudio'")


def test_selfcheck_passes_its_environment_layer_without_the_packages() -> None:
    report = selfcheck.run(registry.load("cpu"), ["environment"])
    [layer] = report.layers
    assert layer.ok
    assert [c.name for c in layer.checks] == ["torchvision", "torchaudio", "torchcodec"]
    for check in layer.checks:
        assert check.detail in ("not installed (asyncrl does not need it)", "imports")

"""Why an import failed: the module that did not import, and torch's companion packages that
are installed but do not load against the installed torch.

vLLM's CPU build (``pip install "asyncrl[vllm]"``) pulls in ``torchvision``, ``torchaudio`` and
``torchcodec`` wheels built for another torch. They do not import (``operator torchvision::nms
does not exist``, an undefined symbol), and ``transformers``, which imports them when they are
installed, then fails in every role that builds a model, with ``ModuleNotFoundError: Could not
import module 'GPT2LMHeadModel'``. asyncrl needs none of them: text models do not. So:

- ``broken_companions`` says which of them are installed but fail to import, and why;
- ``uninstall_advice`` turns that into the one command that fixes it;
- ``import_problem`` is the message a role's start gives for an ``ImportError`` raised in its
  ``setup`` (a configuration error, ``asyncrl.supervision.process``): the role, the module, and the
  fix.

``asyncrl selfcheck`` runs ``broken_companions`` as its first layer (``environment``).
Importing this module imports nothing beyond the standard library; the checks import the
companions (and so torch) only when called.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys

__all__ = ["COMPANIONS", "broken_companions", "import_problem", "uninstall_advice"]

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
"""torch's companion packages that wheels of another torch break, and asyncrl never needs."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def broken_companions() -> dict[str, str]:
    """Each companion package that is installed but fails to import, with what to say of it
    (its name, version and the exception's first line); empty when none is broken.

    A package that is not installed is not broken. One already imported is fine.
    """
    broken: dict[str, str] = {}
    for name in COMPANIONS:
        if name in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure to load is what we look for
            version = _version(name)
            label = name if version == "?" else f"{name} {version}"
            broken[name] = f"{label} ({_first_line(exc)})"
    return broken


def uninstall_advice(broken: dict[str, str]) -> str:
    """What to say about ``broken`` (from ``broken_companions``): which packages do not load
    against the installed torch, and the command that removes them; "" when none is broken."""
    if not broken:
        return ""
    names = " ".join(broken)
    return (
        f"Installed but not loadable against torch {_version('torch')}: "
        f"{', '.join(broken.values())}. vLLM's CPU build pulls in such wheels, and transformers "
        f"fails to import its models while they are installed; asyncrl needs none of them: "
        f"uninstall them with '{sys.executable} -m pip uninstall -y {names}'"
    )


def _modules(exc: BaseException) -> tuple[str, BaseException]:
    """The name of the module that failed to import (the innermost ``ImportError`` of the
    chain that names one, else ""), and the innermost exception of the chain."""
    name = ""
    seen: set[int] = set()
    current: BaseException | None = exc
    root = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ImportError) and current.name:
            name = current.name
        root = current
        current = current.__cause__ or current.__context__
    return name, root


def import_problem(exc: ImportError, where: str) -> str:
    """The message for ``exc`` raised while ``where`` (``roles.learner[0] setup``) ran.

    It names the module that failed to import, the original error, and what to do: install the
    missing module into the run's Python environment, and uninstall the broken companion
    packages when there are any.
    """
    module, root = _modules(exc)
    what = f"module {module!r}" if module else "a module"
    said = _first_line(exc)
    if root is not exc:
        said += f" (caused by {_first_line(root)})"
    parts = [f"{where} could not import {what}: {said}"]
    advice = uninstall_advice(broken_companions())
    if module or not advice:
        fix = f"'{module.split('.')[0]}'" if module else "the package it needs"
        parts.append(
            f"Install {fix} into the run's Python environment ({sys.executable}), or fix the "
            f"module named in the role's config"
        )
    if advice:
        parts.append(advice)
    return ". ".join(parts)

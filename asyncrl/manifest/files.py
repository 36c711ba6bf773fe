"""Whether what a manifest starts is there: the executable of each ``command`` role and a program
given as a file, looked up as the node agent will start them, from the directory the run starts
in (``asyncrl.manifest.load.load_manifest`` with ``check_files``).

A module is never looked up: that would import user code, which the agent never does.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from typing import Any

from asyncrl.manifest._schema import join

__all__ = ["check_files"]


def check_files(clean: Any, cwd: str, problems: list[str], program_form: re.Pattern[str]) -> None:
    """Report a program file that does not exist, and each role whose ``command[0]`` names no
    executable, as the agent would start them from ``cwd``.

    ``clean`` is the manifest as the schema cleaned it; ``program_form`` matches a program,
    with the groups ``module`` and ``function``.
    """
    if not isinstance(clean, dict) or not isinstance(clean.get("roles"), dict):
        return
    run = clean.get("run")
    run_env = run.get("env") if isinstance(run, dict) else None
    program = run.get("program") if isinstance(run, dict) else None
    if isinstance(program, str) and not any(p.startswith("run.program:") for p in problems):
        problem = _program_problem(program, cwd, program_form)
        if problem:
            problems.append(f"run.program: {problem}")
    for name, role in clean["roles"].items():
        if not isinstance(role, dict):
            continue
        command = role.get("command")
        where = f"{join(join('roles', name), 'command')}[0]"
        if not isinstance(command, list) or not command or not isinstance(command[0], str):
            continue  # a problem of its own already, or no command at all
        if any(p.startswith((where.removesuffix("[0]") + ":", where + ":")) for p in problems):
            continue
        env = {**os.environ}
        for extra in (run_env, role.get("env")):
            if isinstance(extra, dict):
                env.update({k: v for k, v in extra.items() if isinstance(v, str)})
        problem = _executable_problem(command[0], cwd, env.get("PATH", os.defpath))
        if problem:
            problems.append(f"{where}: {problem}")


def _program_problem(program: str, cwd: str, program_form: re.Pattern[str]) -> str | None:
    """Why the file of a ``path/to/file.py:function`` program is missing, or None.

    A module is not looked up: that would import user code, which the agent never does.
    """
    match = program_form.fullmatch(program)
    if match is None or not match["module"].endswith(".py"):
        return None
    where = match["module"]
    full = os.path.normpath(os.path.join(cwd, where))
    if os.path.isfile(full):
        return None
    shown = repr(where) if full == where else f"{where!r} ({full})"
    return (
        f"no program file {shown}; fix the path (a relative path is taken from the directory "
        "the run starts in), or name a module as 'package.module:function'"
    )


def _executable_problem(program: str, cwd: str, path: str) -> str | None:
    """Why ``program`` cannot be started from ``cwd`` with ``PATH`` ``path``, or None."""
    if not program:
        return "the program is an empty string; give the executable to run"
    if "/" not in program:
        # A relative PATH entry (or an empty one) is taken from the directory of the agent.
        path = os.pathsep.join(os.path.join(cwd, d or ".") for d in path.split(os.pathsep))
        if shutil.which(program, path=path) is not None:
            return None
        return (
            f"no executable {program!r} found on PATH; install it, give its path (such as "
            f"'./{program}' for one in {cwd}), or add its folder to PATH in run.env or the "
            "role's env"
        )
    full = os.path.normpath(os.path.join(cwd, program))
    shown = repr(program) if full == program else f"{program!r} ({full})"
    try:
        mode = os.stat(full).st_mode
    except OSError:
        return (
            f"no executable {shown}: the file does not exist; fix the path (a relative path "
            "is taken from the directory the run starts in) or give it as an absolute path"
        )
    if stat.S_ISDIR(mode):
        return f"{shown} is a directory, not an executable; name the program inside it"
    if not os.access(full, os.X_OK):
        return (
            f"{shown} is not executable; make it executable (chmod +x) or start it through "
            f"its interpreter, such as [python3, {program}]"
        )
    return None

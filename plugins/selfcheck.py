"""``asyncrl selfcheck [--plugin NAME] [--json] [--layers ...]``: what works on this hardware.

Runs each layer of the plugin contract and reports it on its own, so a vendor sees which one is
broken: first the environment (torch's companion packages ``torchvision``, ``torchaudio`` and
``torchcodec`` each absent or loading against the installed torch: wheels built for another
torch, as vLLM's CPU build pulls in, break transformers' model imports, and the layer says what
to uninstall; ``asyncrl.imports``), then communication (each collective across 2 local
processes), operators (fast against reference: max error, speed ratio), compilation (bucketed
compile against eager), memory, checkpoints (written under one device and dtype, loaded under
another) and end to end (a tiny behaviour-cloning run, then a tiny GRPO run). Prints a table,
or with ``--json`` one object
``{"plugin", "layers": [{"name", "ok", "checks": [...]}], "ok"}``. Exit status: 0 when every
layer passed, 1 when one failed, 2 when the plugin cannot run here (unknown, refused, or its
device unavailable: each layer is then skipped with the reason).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence

import msgspec
import torch

from asyncrl.imports import COMPANIONS, broken_companions, uninstall_advice
from asyncrl.plugins import registry
from asyncrl.plugins.contract import Plugin
from asyncrl.plugins.errors import PluginError
from asyncrl.plugins.selfcheck_comm import run_collectives
from asyncrl.plugins.selfcheck_layers import Check, compilation, memory, operators
from asyncrl.plugins.selfcheck_runs import checkpoints, end_to_end

__all__ = ["LAYERS", "Layer", "Report", "main", "run"]


class Layer(msgspec.Struct):
    """One layer's result.

    Attributes:
        name: the layer.
        ok: every check passed (a skipped layer is not ok).
        checks: what it checked.
        skipped: why it did not run (empty: it ran).
        seconds: how long it took.
    """

    name: str
    ok: bool
    checks: list[Check]
    skipped: str = ""
    seconds: float = 0.0


class Report(msgspec.Struct):
    """The self-check of one plugin: its layers, and whether all passed."""

    plugin: str
    layers: list[Layer]
    ok: bool


def _communication(plugin: Plugin, device: torch.device) -> list[Check]:
    # NCCL needs a device per rank: with fewer than 2, the collectives go over gloo.
    enough = plugin.device.kind == "cpu" or plugin.device.count() >= 2
    backend = plugin.comm.backend if enough else "gloo"
    note = "" if enough else f" (gloo: {plugin.comm.backend} needs 2 devices)"
    return [
        Check(
            c["name"],
            c["ok"],
            speed=None,
            detail=f"{c['detail']}; median {c['seconds'] * 1e3:.3f} ms{note}",
        )
        for c in run_collectives(plugin.name, backend)
    ]


def environment(plugin: Plugin, device: torch.device) -> list[Check]:
    """One check per companion package of torch (absent, or it imports), and when any is
    broken a last check ``uninstall`` whose detail is the command that removes them."""
    broken = broken_companions()
    checks = []
    for name in COMPANIONS:
        if name in broken:
            checks.append(Check(name, False, detail=f"does not import: {broken[name]}"))
        elif importlib.util.find_spec(name) is None:
            checks.append(Check(name, True, detail="not installed (asyncrl does not need it)"))
        else:
            checks.append(Check(name, True, detail="imports"))
    if broken:
        checks.append(Check("uninstall", False, detail=uninstall_advice(broken)))
    return checks


LAYERS: dict[str, Callable[[Plugin, torch.device], list[Check]]] = {
    "environment": environment,
    "communication": _communication,
    "operators": operators,
    "compilation": compilation,
    "memory": memory,
    "checkpoints": checkpoints,
    "end_to_end": end_to_end,
}
"""The layers, in the order they run."""


def run(plugin: Plugin, layers: Sequence[str] = tuple(LAYERS)) -> Report:
    """Run ``layers`` of the self-check on ``plugin``; a layer that raises fails with the
    error as its one check."""
    if not plugin.device.available():
        # The environment needs no device: it is checked all the same.
        why = f"{plugin.name}: no {plugin.device.kind} device available in this process"
        out = [
            _layer(name, plugin, torch.device("cpu"))
            if name == "environment"
            else Layer(name, False, [], skipped=why)
            for name in layers
        ]
        return Report(plugin.name, out, False)
    device = plugin.device.select(0)
    out = [_layer(name, plugin, device) for name in layers]
    return Report(plugin.name, out, all(layer.ok for layer in out))


def _layer(name: str, plugin: Plugin, device: torch.device) -> Layer:
    """Run one layer; one that raises fails with the error as its one check."""
    start = time.perf_counter()
    try:
        checks = LAYERS[name](plugin, device)
    except Exception as exc:
        checks = [Check(name, False, detail=f"{type(exc).__name__}: {exc}")]
    ok = bool(checks) and all(c.ok for c in checks)
    return Layer(name, ok, checks, seconds=time.perf_counter() - start)


def _cell(check: Check) -> tuple[str, str]:
    correct = "yes" if check.ok else "NO"
    if check.max_error is not None:
        correct += f" (err {check.max_error:.1e})"
    speed = "" if check.speed is None else f"x{check.speed:.2f}"
    return correct, speed


def table(report: Report) -> str:
    """The report as a text table: layer / covered / correct / speed, then each check's
    detail."""
    rows = [("layer", "covered", "correct", "speed", "detail")]
    for layer in report.layers:
        if layer.skipped:
            rows.append((layer.name, "-", "skipped", "", layer.skipped))
            continue
        for i, check in enumerate(layer.checks):
            head = f"{layer.name} ({'ok' if layer.ok else 'FAILED'}, {layer.seconds:.1f} s)"
            rows.append((head if i == 0 else "", check.name, *_cell(check), check.detail))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=False)) + "  " + r[4]
        for r in rows
    ]
    verdict = (
        "all layers passed"
        if report.ok
        else "FAILED: " + ", ".join(layer.name for layer in report.layers if not layer.ok)
    )
    return "\n".join([f"asyncrl selfcheck: plugin {report.plugin}", *lines, verdict])


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``asyncrl selfcheck``). Output: the exit status."""
    parser = argparse.ArgumentParser(prog="asyncrl selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--plugin", default="", help="a registered plugin (default: detected)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS), help="layers to run"
    )
    args = parser.parse_args(argv)
    name = registry.choose(args.plugin)
    try:
        plugin = registry.load(name)
    except PluginError as exc:
        print(f"asyncrl selfcheck: {exc}", file=sys.stderr)
        return 2
    report = run(plugin, args.layers)
    print(msgspec.json.encode(report).decode() if args.json else table(report))
    if report.ok:
        return 0
    return 2 if any(layer.skipped for layer in report.layers) else 1


if __name__ == "__main__":
    sys.exit(main())

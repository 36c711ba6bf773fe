"""Two torch roles sharing one device in a real run: each holds the memory share its placement
gives and reports its own memory to ``asyncrl status``, and a role that frees a big buffer and
releases its cache shows its resident memory drop (measured by the role, and from outside
through /proc)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncrl.plugins.registry import device_for
from asyncrl.role import Role, endpoint
from asyncrl.roles.device_report import DeviceShare
from tests.conftest import ROOT
from tests.integration.test_runtime import Run, start_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MIB = 2**20
BALLAST_MIB = 192

PROGRAM = """\
import asyncio
import os

async def main(ctx):
    await ctx.roles["ballast"].call("fill", {mib})
    ctx.log.info("colocation filled")
    while not os.path.exists(ctx.config["gate"]):
        await asyncio.sleep(0.05)
    await ctx.roles["ballast"].call("free", None)
    ctx.log.info("colocation freed")
    await asyncio.Event().wait()
"""

MANIFEST = """\
run:
  name: colocation
  program: {program}:main
  config: {{gate: {gate}}}
roles:
  reference:
    class: asyncrl.roles.services.reference:Reference
    placement: {{device: cpu, memory_fraction: 0.3}}
    config:
      model_config: {{model_type: gpt2, vocab_size: 14, n_positions: 16, n_embd: 32,
                      n_layer: 1, n_head: 2}}
  ballast:
    class: tests.supervision.test_colocation_run:Ballast
    placement: {{device: cpu, memory_fraction: 0.3, release_when_idle: true}}
"""


class Ballast(Role):
    """A torch role holding a big buffer the way a model's activations do: many 1 MiB tensors
    from the heap, which freeing alone leaves resident."""

    share: DeviceShare | None = None

    async def setup(self) -> None:
        self.share = DeviceShare.for_role(self.ctx, device_for(self.ctx.device))
        self.held: list[torch.Tensor] = []

    def status(self) -> dict[str, Any]:
        return {} if self.share is None else self.share.status()

    @endpoint()
    async def fill(self, mib: int) -> int:
        def fill() -> int:
            torch.ones(8 * MIB // 4)  # freed at once: raises glibc's mmap threshold to 8 MiB
            self.held = [torch.ones(MIB // 4) for _ in range(mib)]
            self.held.append(torch.ones(MIB // 4))  # kept: the heap cannot shrink from its top
            return mib

        return await self.ctx.offload(fill)

    @endpoint()
    async def free(self, _: Any) -> dict[str, int]:
        def free() -> dict[str, int]:
            del self.held[:-1]
            assert self.share is not None
            return self.share.release()

        return await self.ctx.offload(free)


def _status(run_dir: str) -> dict[str, dict[str, Any]]:
    """Each serving role's process entry of ``asyncrl status --json``, by role name."""
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.observe.status", run_dir, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    return {p["role"]: p for n in found["nodes"] for p in n["processes"] if "status" in p}


def _rss(pid: int) -> int:
    """The resident memory of process ``pid``, read from outside it."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    run_dir = tempfile.mkdtemp(prefix="arl-")
    program, manifest = os.path.join(run_dir, "program.py"), os.path.join(run_dir, "m.yaml")
    with open(program, "w") as f:
        f.write(PROGRAM.format(mib=BALLAST_MIB))
    with open(manifest, "w") as f:
        gate = os.path.join(run_dir, "gate")
        f.write(textwrap.dedent(MANIFEST.format(program=program, gate=gate)))
    started = start_run(manifest, run_dir, env={"OMP_NUM_THREADS": "1"})
    try:
        started.wait_for_each(
            ("colocation filled",),
            *(("serving", f"process={p}[0]") for p in ("reference", "ballast")),
        )
        yield started
    finally:
        started.proc.send_signal(signal.SIGINT)
        started.proc.communicate(timeout=60)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_each_role_reports_its_own_memory_and_a_release_drops_it(run: Run) -> None:
    before = _status(run.run_dir)
    assert sorted(before) == ["ballast", "reference"]
    mem = {role: p["status"]["role"]["memory"] for role, p in before.items()}
    pids = {role: p["pid"] for role, p in before.items()}
    assert pids["ballast"] != pids["reference"]
    for role in ("ballast", "reference"):
        assert before[role]["status"]["role"]["device"] == "cpu"
        # What the role reports is its own process's resident set, as /proc shows it.
        assert abs(mem[role]["allocated"] - _rss(pids[role])) < 16 * MIB, (role, mem[role])
    assert mem["ballast"]["total"] == mem["reference"]["total"] > 0
    # The ballast holds its buffer on top of what a torch process needs anyway.
    assert mem["ballast"]["allocated"] - mem["reference"]["allocated"] > 100 * MIB

    with open(os.path.join(run.run_dir, "gate"), "w"):
        pass
    run.wait_for("colocation freed")
    after = _status(run.run_dir)
    ballast = after["ballast"]["status"]["role"]
    released = ballast["last_release"]
    assert ballast["releases"] == 1
    # The role's own measure, around its release: the freed buffer leaves the resident set.
    assert released["allocated_before"] - released["allocated_after"] > 0.9 * BALLAST_MIB * MIB
    dropped = mem["ballast"]["allocated"] - ballast["memory"]["allocated"]
    assert dropped > 0.9 * BALLAST_MIB * MIB, (mem["ballast"], ballast["memory"])
    assert _rss(pids["ballast"]) < mem["ballast"]["allocated"] - 0.9 * BALLAST_MIB * MIB
    # The other role's memory is its own: the ballast's release takes nothing from it.
    reference = after["reference"]["status"]["role"]
    assert reference["releases"] == 0
    assert reference["memory"]["allocated"] > mem["reference"]["allocated"] - 16 * MIB


def test_each_role_holds_the_share_its_placement_gives(run: Run) -> None:
    found = _status(run.run_dir)
    shares = {
        role: (p["status"]["role"]["memory_fraction"], p["status"]["role"]["release_when_idle"])
        for role, p in found.items()
    }
    assert shares == {"reference": (0.3, False), "ballast": (0.3, True)}
    memory = found["reference"]["status"]["role"]["memory"]
    assert memory["limit"] == int(0.3 * memory["total"])

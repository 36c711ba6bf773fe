"""A node's attempt in a launch (``asyncrl.supervision.multinode``): a store that fails during
the attempt, while its heartbeat runs beside it, reaches ``asyncrl.launch`` as the store's own
error, which it says in one line."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from typing import Any

import pytest

from asyncrl.supervision import multinode
from asyncrl.supervision.store_registry import StoreError
from tests.conftest import ROOT


class _Store:
    """A store that answers what the attempt asks before it takes part."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def connect(self) -> None:
        pass

    async def peek(self, key: str) -> None:
        return None


class _Attempt:
    """An attempt that prepares, and beats until cancelled."""

    def __init__(self) -> None:
        self.beating = asyncio.Event()

    async def prepare(self, args: argparse.Namespace, timeout_s: float) -> str:
        return ""

    def write_launch(self) -> None:
        pass

    async def heartbeat(self) -> None:
        while True:
            self.beating.set()
            await asyncio.sleep(0.001)


def test_a_store_failing_during_the_attempt_is_said_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    async def join(*args: Any, **kwargs: Any) -> _Attempt:
        return _Attempt()

    async def take_part(args: argparse.Namespace, a: _Attempt) -> int:
        await a.beating.wait()  # the heartbeat runs beside the attempt
        raise StoreError("waited 300 s for node 1 to publish its endpoints")

    monkeypatch.setattr(multinode, "StoreClient", _Store)
    monkeypatch.setattr(multinode.NodeAttempt, "join", join)
    monkeypatch.setattr(multinode, "_take_part", take_part)
    for name, value in {
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "TORCHELASTIC_RUN_ID": "r",
    }.items():
        monkeypatch.setenv(name, value)
    umask = os.umask(0o022)
    try:
        code = multinode.main([f"{ROOT}/examples/hello/manifest.yaml", "--run-dir", str(tmp_path)])
    finally:
        os.umask(umask)
    err = capsys.readouterr().err
    assert code == 1
    assert err == "asyncrl.launch[node 0]: waited 300 s for node 1 to publish its endpoints\n"


class _BeatingStore:
    """The store's calls node 0's ``finish`` makes, over a dict; ``beating`` nodes raise their
    heartbeat at each look."""

    def __init__(self, beating: set[str]) -> None:
        self.values: dict[str, str] = {}
        self.beating = beating

    async def set(self, key: str, value: str) -> None:
        self.values[key] = value

    async def set_once(self, key: str, value: str) -> str:
        return self.values.setdefault(key, value)

    async def check(self, key: str) -> bool:
        return key in self.values

    async def peek(self, key: str) -> str | None:
        if key in self.beating:
            self.values[key] = str(int(self.values.get(key, "0")) + 1)
        return self.values.get(key)

    async def add(self, key: str, amount: int) -> int:
        self.values[key] = str(int(self.values.get(key, "0")) + amount)
        return int(self.values[key])


def test_node_0_does_not_wait_for_a_node_lost_as_the_run_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run ends on node 0 just as node 2 dies, before the watch took it as lost: node 0
    stops waiting for node 2 once its heartbeat has been silent for the liveness (not for the
    join timeout), and counts it in torchrun's exit barrier, so that the live torchruns exit
    at once rather than after the barrier's 300 s. Node 1, whose heartbeat goes on, is
    waited for until it says it stopped its roles."""
    from asyncrl.manifest.load import load_manifest
    from asyncrl.supervision.runreport import RunReport
    from asyncrl.supervision.store_registry import LaunchKeys

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    keys = LaunchKeys("r")
    store = _BeatingStore({keys.heartbeat(0, 1)})
    env = multinode.LaunchEnv(0, 3, "127.0.0.1", 1, "r", False)
    manifest = load_manifest(f"{ROOT}/examples/hello/manifest.yaml")
    a = multinode.NodeAttempt(env, store, keys, 0, manifest, str(tmp_path))  # type: ignore[arg-type]

    async def main() -> int:
        finishing = asyncio.create_task(
            a.finish(RunReport("completed", "the program returned"), 60.0, (), 0.5)
        )
        await asyncio.sleep(1.5)
        assert not finishing.done()  # node 1 beats and has not said it stopped
        await store.set(keys.done(0, 1), '{"restarts": {"splitter": 2}, "served": {}}')
        return await asyncio.wait_for(finishing, 10)

    assert asyncio.run(main()) == 0
    barrier = f"r/{multinode.TORCHRUN_EXIT_BARRIER}/num_members"
    assert store.values[barrier] == "1"
    err = capsys.readouterr().err
    assert re.search(
        r"the agent of node 2 sent no heartbeat for \d+\.\d s as the run ended: node 2 is lost", err
    )
    assert "waited" not in err

"""A node's attempt in a launch (``asyncrl.supervision.multinode``): a store that fails during
the attempt, while its heartbeat runs beside it, reaches ``asyncrl.launch`` as the store's own
error, which it says in one line."""

from __future__ import annotations

import argparse
import asyncio
import os
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

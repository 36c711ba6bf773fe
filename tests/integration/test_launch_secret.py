"""The nodes of a launch agree on the run's secret through torchrun's real TCPStore, and nothing
the store holds reveals it: with Curve keys each node derives it from the key folder; without,
node 0's secret file is read where the nodes share a filesystem, and a node that cannot read it
refuses the launch."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
from typing import Any

import pytest

from asyncrl.keys import generate
from asyncrl.supervision.launch_secret import derive_secret, shared_secret
from asyncrl.supervision.store_registry import StoreClient
from asyncrl.transport import load_keys
from asyncrl.transport.control import read_secret

PREFIX = "asyncrl/run-1/attempt-0"


class RecordingStore(StoreClient):
    """A real store client that also keeps every key and value it writes, for the test to read
    all the store ever held of the launch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written: list[tuple[str, str]] = []

    async def set(self, key: str, value: str) -> None:
        self.written.append((key, value))
        await super().set(key, value)

    async def set_once(self, key: str, value: str) -> str:
        self.written.append((key, value))
        return await super().set_once(key, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _launch(dirs: list[str], keys: list[str]) -> tuple[list[tuple[str, str]], list[Any]]:
    """Both nodes' ``shared_secret`` at once, against one real TCPStore: (what was written to
    the store, each node's (secret, problem))."""
    master = RecordingStore("127.0.0.1", _free_port(), is_master=True, timeout_s=30)
    await master.connect()
    other = RecordingStore("127.0.0.1", master.port, timeout_s=30)
    await other.connect()
    results = await asyncio.gather(
        shared_secret(master, PREFIX, 0, dirs[0], keys[0], 30.0),
        shared_secret(other, PREFIX, 1, dirs[1], keys[1], 30.0),
    )
    return master.written + other.written, list(results)


def _reveals_nothing(written: list[tuple[str, str]], secret: str) -> None:
    assert written  # the store was used
    for key, value in written:
        for held in (key, value):
            assert secret not in held
            assert secret.encode().hex() not in held
            assert secret[:16] not in held and secret[-16:] not in held


def test_with_curve_keys_every_node_derives_the_secret_and_the_store_holds_none(
    tmp_path: Any,
) -> None:
    run_dir = str(tmp_path / "run")
    generate(str(tmp_path / "keys"))
    shutil.copytree(tmp_path / "keys", tmp_path / "keys-copy")  # node 1's copy of the folder
    keys = [str(tmp_path / "keys"), str(tmp_path / "keys-copy")]
    written, results = asyncio.run(_launch([run_dir, os.path.join(run_dir, "node-1")], keys))
    (secret, problem), (secret_1, problem_1) = results
    assert (problem, problem_1) == ("", "")
    assert secret == secret_1 and len(secret) == 64
    _reveals_nothing(written, secret)
    # It is the HMAC of the attempt and the nonce node 0 put in the store, keyed by the folder.
    (record,) = [json.loads(v) for k, v in written if k == f"{PREFIX}/secret-record"]
    assert sorted(record) == ["check", "nonce"]
    server_key = load_keys(keys[0]).server_secret
    assert derive_secret(server_key, f"{PREFIX}/{record['nonce']}") == secret
    assert not os.path.exists(os.path.join(run_dir, "secret"))  # the agent writes it later
    # Another launch (another nonce) has another secret.
    _, again = asyncio.run(_launch([run_dir, os.path.join(run_dir, "node-1")], keys))
    assert again[0][0] == again[1][0] != secret


def test_a_node_with_another_key_folder_refuses_the_launch(tmp_path: Any) -> None:
    generate(str(tmp_path / "keys"))
    generate(str(tmp_path / "other"))
    keys = [str(tmp_path / "keys"), str(tmp_path / "other")]
    _, results = asyncio.run(_launch([str(tmp_path), str(tmp_path / "node-1")], keys))
    assert results[0][1] == ""
    assert results[1] == (
        "",
        f"node 1 derives another run secret from its security.curve_keys ({keys[1]}) than "
        "node 0 from its own: the two key folders differ, and the nodes' processes would "
        "refuse one another; copy node 0's key folder to every node",
    )


def test_without_keys_node_0s_file_carries_it_and_the_store_holds_none(tmp_path: Any) -> None:
    run_dir = str(tmp_path / "run")
    os.makedirs(os.path.join(run_dir, "node-1"))
    written, results = asyncio.run(_launch([run_dir, os.path.join(run_dir, "node-1")], ["", ""]))
    (secret, problem), (secret_1, problem_1) = results
    assert (problem, problem_1) == ("", "")
    assert secret == secret_1 == read_secret(os.path.join(run_dir, "secret"))
    assert os.stat(os.path.join(run_dir, "secret")).st_mode & 0o777 == 0o600
    _reveals_nothing(written, secret)


def test_without_keys_a_node_that_cannot_read_node_0s_file_refuses_the_launch(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machines apart: node 1 does not see node 0's folder (here: node 0's file is gone by the
    time node 1 looks)."""
    run_dir = str(tmp_path / "run")
    os.makedirs(os.path.join(run_dir, "node-1"))
    import asyncrl.supervision.launch_secret as launch_secret

    written_file = launch_secret.write_secret

    def write_elsewhere(path: str, secret: str) -> None:
        written_file(path, secret)
        os.unlink(path)  # what a node on another machine sees: no such file

    monkeypatch.setattr(launch_secret, "write_secret", write_elsewhere)
    _, results = asyncio.run(_launch([run_dir, os.path.join(run_dir, "node-1")], ["", ""]))
    path = os.path.join(run_dir, "secret")
    assert results[0][1] == ""
    assert results[1] == (
        "",
        f"node 1 cannot read the run's secret from node 0's file {path} (No such file or "
        "directory), and the manifest has no security.curve_keys. The secret never goes "
        "through the launch's store, which anyone who reaches MASTER_PORT can read: nodes on "
        "separate machines derive it from the CurveZMQ key folder they share. Make one with "
        "'asyncrl keys generate DIR', copy it to every node and set security.curve_keys (it "
        "also encrypts the tcp traffic between nodes), or give every node the same --run-dir "
        "on one filesystem",
    )

"""The plugins' collectives (asyncrl.plugins.collectives) in a real gloo group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from asyncrl.plugins.collectives import PairGroup, TorchCommunication
from asyncrl.plugins.errors import CollectiveTimeoutError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_long_run_of_collectives_leaves_the_store_a_bounded_number_of_marks() -> None:
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        comm = TorchCommunication("gloo")
        before = store.num_keys()
        for _ in range(40):
            tensor = torch.ones(3)
            comm.all_reduce(tensor, timeout_s=10.0)
            assert tensor.tolist() == [1.0, 1.0, 1.0]
            comm.barrier(timeout_s=10.0)
        # Each collective marks its rank's arrival; only the last two marks are kept, not 80.
        assert store.num_keys() - before == 2
        group_store = dist.distributed_c10d._get_default_store()  # the group's prefix on it
        assert group_store.check(["asyncrl/barrier/80/0", "asyncrl/all_reduce/79/0"])
        assert not group_store.check(["asyncrl/barrier/78/0"])
    finally:
        dist.destroy_process_group()


class _Pending:
    """A collective's work that never completes (a peer that went silent)."""

    def is_completed(self) -> bool:
        return False


class _Silent:
    """A backend whose broadcast never completes."""

    def broadcast(self, tensors: list[torch.Tensor], options: object) -> _Pending:
        return _Pending()


def test_a_pair_group_times_out_even_when_its_store_host_went_silent() -> None:
    """A pair group's store is hosted by the peer (a relay's rendezvous store). When that peer
    stops answering with its connections open (its host frozen or cut off), the collective
    times out at its deadline: the question of which ranks arrived, which the store never
    answers, is given up after 2 s instead of holding the transfer for ever."""
    port = _free_port()
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, sys, time, torch.distributed as d\n"
            f"s = d.TCPStore('127.0.0.1', {port}, None, True, "
            "timeout=datetime.timedelta(seconds=30), wait_for_workers=False)\n"
            "print('up', flush=True)\n"
            "time.sleep(300)\n",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert host.stdout is not None and host.stdout.readline() == b"up\n"
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        group = PairGroup(_Silent(), store, 0, 2, torch.device("cpu"))
        os.kill(host.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as raised:
            TorchCommunication("gloo").broadcast(torch.ones(3), 0, timeout_s=0.5, group=group)
        took = time.monotonic() - started
        assert raised.value.missing == []  # unknown: the store did not answer
        # At least its 0.5 s deadline and the 2 s given to the silent store; the upper bound
        # only says it ended (a hang holds it for ever), with room for a loaded machine.
        assert 2.5 <= took < 60.0, took
    finally:
        host.kill()
        host.wait()
        assert host.stdout is not None
        host.stdout.close()

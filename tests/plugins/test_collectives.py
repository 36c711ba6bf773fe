"""The plugins' collectives (asyncrl.plugins.collectives) in a real gloo group."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.plugins.collectives import TorchCommunication


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

"""The local registry: stable endpoints and atomic registrations."""

from __future__ import annotations

import os

import pytest

from asyncrl.transport import Entry, LocalRegistry


def test_endpoints_are_stable_and_registrations_readable(run_dir: str) -> None:
    reg = LocalRegistry(run_dir)
    endpoint = reg.endpoint("rollout", 1)
    assert endpoint == f"ipc://{run_dir}/sockets/rollout.1"
    assert LocalRegistry(run_dir).endpoint("rollout", 1) == endpoint
    assert reg.lookup("rollout", 1) is None
    reg.register(Entry("rollout", 1, endpoint, pid=10, incarnation=0))
    reg.register(Entry("rollout", 1, endpoint, pid=11, incarnation=1))
    reg.register(Entry("learner", 0, reg.endpoint("learner", 0), pid=12))
    assert reg.lookup("rollout", 1) == Entry("rollout", 1, endpoint, pid=11, incarnation=1)
    assert [(e.name, e.replica) for e in reg.entries()] == [("learner", 0), ("rollout", 1)]
    assert not [f for f in os.listdir(os.path.join(run_dir, "registry")) if f.startswith(".")]


def test_long_run_dirs_get_short_socket_paths(run_dir: str) -> None:
    deep = os.path.join(run_dir, "a" * 60, "b" * 60)
    reg = LocalRegistry(deep)
    endpoint = reg.endpoint("reward", 3)
    assert len(endpoint) - len("ipc://") <= 107
    assert endpoint == LocalRegistry(deep).endpoint("reward", 3)
    assert LocalRegistry(deep + "x").endpoint("reward", 3) != endpoint


def test_bad_names_are_refused(run_dir: str) -> None:
    reg = LocalRegistry(run_dir)
    with pytest.raises(ValueError, match="may hold only letters, digits"):
        reg.endpoint("../evil", 0)
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        reg.endpoint("rollout", -1)

"""``asyncrl.supervision.hosts``: node ranks on one host link their ``weights`` folder to the host's
first node's, after reading its token there; one that cannot see it is refused, naming
``ASYNCRL_HOST_ID``."""

from __future__ import annotations

import os

import pytest

from asyncrl.supervision.hosts import HostRecord, announce, first_node, share


def _nodes(tmp: str, hosts: list[str]) -> tuple[list[str], dict[int, HostRecord]]:
    dirs = [os.path.join(tmp, "run" if n == 0 else f"run/node-{n}") for n in range(len(hosts))]
    records = {}
    for n, (folder, host) in enumerate(zip(dirs, hosts, strict=True)):
        mine = announce(folder)
        records[n] = HostRecord(host=host, weights=mine.weights, token=mine.token)
    return dirs, records


def test_a_node_on_the_host_of_a_lower_node_links_to_its_weights(tmp_path: object) -> None:
    dirs, records = _nodes(str(tmp_path), ["a", "b", "a", "b"])
    assert [first_node(n, records) for n in range(4)] == [0, 1, 0, 1]
    stale = os.path.join(dirs[2], "weights", "learner.json")
    with open(stale, "w") as f:
        f.write("{}")
    assert [share(n, dirs[n], records) for n in range(4)] == ["", "", "", ""]
    for node, first in ((2, 0), (3, 1)):
        link = os.path.join(dirs[node], "weights")
        assert os.path.islink(link)
        assert os.readlink(link) == records[first].weights
    assert not os.path.islink(os.path.join(dirs[0], "weights"))
    assert not os.path.exists(stale.replace(dirs[2], dirs[0]))
    # A handle written through the link is the first node's: one store for the host.
    with open(os.path.join(dirs[2], "weights", "learner.json"), "w") as f:
        f.write("{}")
    assert sorted(os.listdir(os.path.join(dirs[0], "weights"))) == [".host", "learner.json"]
    # The next attempt: every node first takes a folder of its own again, then links anew.
    again = announce(dirs[2])
    assert not os.path.islink(os.path.join(dirs[2], "weights"))
    assert again.weights == os.path.join(os.path.abspath(dirs[2]), "weights")
    assert share(2, dirs[2], {**records, 2: HostRecord("a", again.weights, again.token)}) == ""
    assert os.path.islink(os.path.join(dirs[2], "weights"))


def test_a_node_that_cannot_see_the_first_nodes_folder_is_refused(tmp_path: object) -> None:
    dirs, records = _nodes(str(tmp_path), ["a", "a"])
    # Node 0's folder as node 1 sees it holds another token (another filesystem at that path).
    elsewhere = HostRecord(host="a", weights=records[0].weights, token="f" * 32)
    problem = share(1, dirs[1], {0: elsewhere, 1: records[1]})
    assert problem == (
        f"node 1 shares its host with node 0 (the same host id, 'a') but cannot see node 0's "
        f"weights folder {records[0].weights} (another node's token is there). Nodes on one "
        f"host share its weight store: give them the same --run-dir on one filesystem, or set "
        f"ASYNCRL_HOST_ID to a different value on each node so that each acts as a host of its "
        f"own (its relay then copies the weights over tcp)"
    )
    assert not os.path.islink(os.path.join(dirs[1], "weights"))
    gone = HostRecord(host="a", weights=os.path.join(str(tmp_path), "nowhere"), token="0")
    problem = share(1, dirs[1], {0: gone, 1: records[1]})
    assert "(unreadable: No such file or directory)" in problem
    assert "ASYNCRL_HOST_ID" in problem


@pytest.mark.parametrize("hosts", [["a", "b"], ["a"]])
def test_a_node_first_on_its_host_keeps_its_folder(tmp_path: object, hosts: list[str]) -> None:
    dirs, records = _nodes(str(tmp_path), hosts)
    assert share(len(hosts) - 1, dirs[-1], records) == ""
    assert not os.path.islink(os.path.join(dirs[-1], "weights"))

"""A node lost while a transfer to or from it is in flight: three torchrun "nodes" on 127.0.0.1
(``tests/integration/test_node_loss.py``'s launch), each a host of its own.

The weight broadcast: a publisher of weights (the learner's ``broadcast_weights`` code over a
real ``PublishedWeights`` store) on node 0, a relay on each of nodes 1 and 2 (``transport:
broadcast``, buckets of 1 MiB, so a version crosses in two), and a reader of its host's store on
every node, as a rollout replica reads it. The program pushes each version through
``WeightSync`` (the relays first, then the readers) and waits until every reader holds it. The
publisher holds the transfer of version 2 to node 2's relay after its first bucket until a gate
file appears, and writes a file when it does: the test loses node 2 then, so the transfer is in
flight when its node goes, and never by a sleep.

The relay's pull: the same publisher and readers, with relays that pull each version from the
publisher's ``weights`` endpoint (``transport: pull``, the default: the version read whole out
of the publisher's store and sent as tensor frames over tcp). Node 2's relay pulls through
``held_weights``, which holds the pull of version 2 once it read the version until the gate
file appears: node 2 is lost while its relay waits for the reply.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.nodes import silence_node
from tests.integration.test_node_loss import Nodes, _json
from tests.integration.transfer_roles import digest, state_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BROADCAST_PROGRAM = """\
import json, os, time

from asyncrl.roles.sampling.weight_sync import WeightSync


async def main(ctx):
    publisher, readers = ctx.roles["publisher"], ctx.roles["reader"]
    relays = [ctx.roles["relay1"], ctx.roles["relay2"]]
    pushes = []
    async with WeightSync(readers, wait=True, timeout=120.0, relays=relays) as sync:
        for _ in range(3):
            version = await publisher.call("bump", None)
            started = time.time()
            versions = await sync.ensure(version)
            pushes.append({
                "version": version,
                "seconds": time.time() - started,
                "ended": time.time(),
                "readers": versions,
                "held": await readers.broadcast("held", None),
                "relays": [
                    [s["version"] for s in await r.broadcast("status", None)] for r in relays
                ],
            })
    # Every transfer ends, the one to the lost relay included: by its error or its deadline.
    outcomes = await publisher.call("outcomes", 5)
    with open(os.path.join(ctx.run_dir, "pushes.json"), "w") as f:
        json.dump({"pushes": pushes, "outcomes": outcomes}, f)
    return [p["version"] for p in pushes]
"""

BROADCAST_MANIFEST = """\
run:
  name: transferloss
  program: {program}:main
roles:
  publisher:
    class: tests.integration.transfer_roles:Publisher
    placement: {{node: 0}}
    config: {{hold_to: relay2, hold_version: 2, held: {held}, gate: {gate}}}
  relay1:
    class: asyncrl.roles.services.relay:Relay
    placement: {{node: 1}}
    config: &relay {{source: publisher, transport: broadcast, bucket_mib: 1, poll_s: 0,
                     timeout_s: 15, source_wait_s: 60}}
  relay2:
    class: asyncrl.roles.services.relay:Relay
    placement: {{node: 2}}
    config: *relay
  reader:
    class: tests.integration.transfer_roles:Reader
    replicas: 3
    placement: {{nodes: [0, 1, 2]}}
"""


PULL_MANIFEST = """\
run:
  name: pullloss
  program: {program}:main
roles:
  publisher:
    class: tests.integration.transfer_roles:Publisher
    placement: {{node: 0}}
    config: {{hold_pull: 2, held: {held}, gate: {gate}}}
  relay1:
    class: asyncrl.roles.services.relay:Relay
    placement: {{node: 1}}
    config: {{source: publisher, poll_s: 0, timeout_s: 15, source_wait_s: 60}}
  relay2:
    class: asyncrl.roles.services.relay:Relay
    placement: {{node: 2}}
    config: {{source: publisher, weights_method: held_weights, poll_s: 0, timeout_s: 15,
             source_wait_s: 60}}
  reader:
    class: tests.integration.transfer_roles:Reader
    replicas: 3
    placement: {{nodes: [0, 1, 2]}}
"""


@pytest.fixture
def nodes(tmp_path: Any) -> Iterator[Nodes]:
    launch = Nodes(str(tmp_path), 3, ("--agent-liveness=4", "--join-timeout=90"))
    try:
        yield launch
    finally:
        launch.kill()


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_node_lost_mid_broadcast_leaves_every_survivor_on_a_whole_version(
    nodes: Nodes, how: str
) -> None:
    """Node 2 (its relay and a reader) is lost while the publisher broadcasts version 2 to its
    relay, one bucket of two sent: ``killed`` (every process of the node SIGKILLed: its
    connections close) or ``silent`` (every process stopped: its connections stay open and
    nothing answers, as when its network is cut). The publisher's side of that transfer ends
    by itself (``BrokenError`` at once, or by its deadline: the relay's ``timeout_s``, 15 s),
    and it serves the other relay meanwhile;
    the program's push leaves the lost relay out once node 0 marks the node lost; every
    survivor holds a whole version (node 1's relay and both readers left hold version 2, byte
    for byte); version 3 crosses to node 1 alone, and the run completes."""
    held, gate = os.path.join(nodes.tmp, "held"), os.path.join(nodes.tmp, "gate")
    program = _write(os.path.join(nodes.tmp, "transfer_program.py"), BROADCAST_PROGRAM)
    nodes.manifest = _write(
        os.path.join(nodes.tmp, "transfer.yaml"),
        BROADCAST_MANIFEST.format(program=program, held=held, gate=gate),
    )
    nodes.start()
    nodes.wait("the broadcast to node 2's relay held mid-transfer", lambda: os.path.exists(held))
    if how == "killed":
        nodes.lose(2)
    else:
        silence_node(nodes.procs[2])
    lost = time.time()
    _write(gate, "")  # the publisher sends its second bucket to a relay that is gone
    codes = nodes.finish([0, 1], timeout=120)
    ended = time.time() - lost
    if how == "silent":
        nodes.lose(2)
    assert codes == [0, 0], nodes.logs()
    record = _json(nodes.path(0, "pushes.json"))
    pushes, outcomes = record["pushes"], record["outcomes"]
    assert [p["version"] for p in pushes] == [1, 2, 3]
    assert [p["readers"] for p in pushes] == [[1, 1, 1], [2, 2], [3, 3]]
    whole = {v: digest(state_of(v)) for v in (1, 2, 3)}
    assert [p["held"] for p in pushes] == [
        [[1, whole[1]]] * 3,
        [[2, whole[2]]] * 2,
        [[3, whole[3]]] * 2,
    ]
    assert [p["relays"] for p in pushes] == [[[1], [1]], [[2], []], [[3], []]]
    # A relay that starts before the first version syncs version 0 at its start. Then version 1
    # reaches each relay first (its start's sync or the push: in either order).
    outcomes = [o for o in outcomes if o[1] > 0]
    assert sorted(outcomes[:2]) == [["relay1.0", 1, "ok"], ["relay2.0", 1, "ok"]]
    # The transfer to the lost relay ended: a killed relay's connection closed (BrokenError);
    # to a silent one the second bucket went into the sockets' buffers (ok) or, when they are
    # smaller than the bucket, the transfer waited for its deadline (CollectiveTimeoutError).
    (lost_transfer,) = [o for o in outcomes[2:] if o[0] == "relay2.0"]
    ends = ["BrokenError"] if how == "killed" else ["ok", "CollectiveTimeoutError"]
    assert lost_transfer[:2] == ["relay2.0", 2] and lost_transfer[2] in ends, outcomes
    assert [o for o in outcomes[2:] if o[0] == "relay1.0"] == [
        ["relay1.0", 2, "ok"],
        ["relay1.0", 3, "ok"],
    ]
    # The push of version 2 waited for node 0 to mark node 2 lost, and no longer.
    waited = pushes[1]["ended"] - lost
    assert waited < 40, (waited, nodes.logs())
    membership = _json(nodes.path(0, "membership.json"))
    assert membership["departed"] == {"relay2": {"0": 2}, "reader": {"2": 2}}
    print(
        f"node 2 {how}: the push of version 2 ended {waited:.1f} s after, the run {ended:.1f} s "
        f"after"
    )


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_relay_lost_mid_pull_leaves_every_survivor_on_a_whole_version(
    nodes: Nodes, how: str
) -> None:
    """Node 2 (its relay and a reader) is lost while its relay pulls version 2: the publisher
    read the version out of its store and holds the reply at the gate. The node is
    ``killed`` (its connections close) or ``silent`` (stopped: they stay open). The publisher
    answers once the gate opens (to a relay that is gone: the reply is dropped, or left in the
    sockets' buffers) and serves node 1's relay meanwhile; the program's push leaves the lost
    relay out once node 0 marks the node lost; every survivor holds a whole version (node 1's
    relay and both readers left hold version 2, byte for byte); version 3 crosses to node 1
    alone, and the run completes."""
    held, gate = os.path.join(nodes.tmp, "held"), os.path.join(nodes.tmp, "gate")
    program = _write(os.path.join(nodes.tmp, "transfer_program.py"), BROADCAST_PROGRAM)
    nodes.manifest = _write(
        os.path.join(nodes.tmp, "pull.yaml"),
        PULL_MANIFEST.format(program=program, held=held, gate=gate),
    )
    nodes.start()
    nodes.wait("node 2's pull of version 2 held", lambda: os.path.exists(held))
    if how == "killed":
        nodes.lose(2)
    else:
        silence_node(nodes.procs[2])
    lost = time.time()
    _write(gate, "")  # the publisher answers a relay that is gone
    codes = nodes.finish([0, 1], timeout=120)
    ended = time.time() - lost
    if how == "silent":
        nodes.lose(2)
    assert codes == [0, 0], nodes.logs()
    record = _json(nodes.path(0, "pushes.json"))
    pushes, outcomes = record["pushes"], record["outcomes"]
    assert [p["version"] for p in pushes] == [1, 2, 3]
    assert [p["readers"] for p in pushes] == [[1, 1, 1], [2, 2], [3, 3]]
    whole = {v: digest(state_of(v)) for v in (1, 2, 3)}
    assert [p["held"] for p in pushes] == [
        [[1, whole[1]]] * 3,
        [[2, whole[2]]] * 2,
        [[3, whole[3]]] * 2,
    ]
    assert [p["relays"] for p in pushes] == [[[1], [1]], [[2], []], [[3], []]]
    # A relay that starts before the first version pulls version 0. Then each pulls version
    # 1 (its start's sync or the push: in either order); node 1's relay pulls 2 and 3 while
    # node 2's pull of 2 waits at the gate, which it leaves after the loss, answered.
    pulls = [o for o in outcomes if o[1] > 0]
    assert sorted(pulls[:2]) == [["held_weights", 1, "ok"], ["weights", 1, "ok"]], outcomes
    assert sorted(pulls[2:]) == [
        ["held_weights", 2, "ok"],
        ["weights", 2, "ok"],
        ["weights", 3, "ok"],
    ], outcomes
    # The push of version 2 waited for node 0 to mark node 2 lost, and no longer.
    waited = pushes[1]["ended"] - lost
    assert waited < 40, (waited, nodes.logs())
    membership = _json(nodes.path(0, "membership.json"))
    assert membership["departed"] == {"relay2": {"0": 2}, "reader": {"2": 2}}
    assert nodes.tracebacks() == [], nodes.logs()
    print(
        f"node 2 {how} mid pull: the push of version 2 ended {waited:.1f} s after, that of "
        f"version 3 {pushes[2]['ended'] - lost:.1f} s after, the run {ended:.1f} s after"
    )


MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 16,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
"""The reference's model: a GPT-2 of 1 layer, built with random weights."""

CHECKPOINT_PROGRAM = """\
import json, os

from asyncrl.roles.generation.rollout import Sample, WeightsUpdate
from asyncrl.roles.training.learner import build_model

MODEL = {model}
SAMPLE = Sample(
    prompt_id="a", sample_index=0, prompt_ids=[2, 3, 12, 4, 13], token_ids=[5, 6, 1],
    logprobs=[0.0] * 3, versions=[0] * 3, finished=True, stop_reason="stop",
)


async def main(ctx):
    reference = ctx.roles["reference"]
    given = []
    for version in (1, 2):
        state = {{k: v.clone() for k, v in build_model("", MODEL, version).state_dict().items()}}
        given.append(await reference.call("set_weights", WeightsUpdate(version, state), int))
    scores = await reference.call("logprobs", [SAMPLE])
    with open(os.path.join(ctx.run_dir, "given.json"), "w") as f:
        json.dump({{"given": given, "logprobs": scores}}, f)
    return given
"""

CHECKPOINT_MANIFEST = """\
run:
  name: checkpointloss
  program: {program}:main
roles:
  reference:
    class: tests.integration.checkpoint_roles:HeldReference
    placement: {{nodes: [1, 0]}}
    config: {{model_config: {model}, seed: 9, hold_version: 2, held: {held}, gate: {gate}}}
"""


@pytest.fixture
def two_nodes(tmp_path: Any) -> Iterator[Nodes]:
    launch = Nodes(str(tmp_path), 2, ("--agent-liveness=4", "--join-timeout=90"))
    try:
        yield launch
    finally:
        launch.kill()


def test_a_node_lost_mid_checkpoint_write_resumes_from_the_last_whole_one(
    two_nodes: Nodes,
) -> None:
    """The reference on node 1 (``placement: {nodes: [1, 0]}``) is writing version 2 of the
    weights it keeps, half of the file on disk, when node 1 is lost. It starts again on node 0
    in node 1's folder: it removes the torn file unread, loads version 1 (the last whole one),
    and the program's ``set_weights`` of version 2, sent again to it, is written whole; the run
    completes."""
    import torch

    from asyncrl.roles.services.reference import WEIGHTS_FILE
    from asyncrl.roles.training.learner import build_model

    nodes = two_nodes
    held, gate = os.path.join(nodes.tmp, "held"), os.path.join(nodes.tmp, "gate")
    model = json.dumps(MODEL)
    program = _write(
        os.path.join(nodes.tmp, "checkpoint_program.py"), CHECKPOINT_PROGRAM.format(model=model)
    )
    nodes.manifest = _write(
        os.path.join(nodes.tmp, "checkpoint.yaml"),
        CHECKPOINT_MANIFEST.format(program=program, model=model, held=held, gate=gate),
    )
    nodes.start()
    nodes.wait("the write of version 2 held halfway", lambda: os.path.exists(held))
    folder = os.path.dirname(_json(held)["path"])
    assert folder == nodes.path(1, "roles", "reference.0")
    (torn,) = [n for n in os.listdir(folder) if n.endswith(".tmp")]
    assert torn.startswith(f".{WEIGHTS_FILE}.")  # half of version 2, beside version 1 whole
    assert torch.load(os.path.join(folder, WEIGHTS_FILE), weights_only=True)["version"] == 1
    nodes.lose(1)
    _write(gate, "")
    assert nodes.finish([0], timeout=120) == [0], nodes.logs()
    assert _json(nodes.path(0, "given.json"))["given"] == [1, 2]
    membership = _json(nodes.path(0, "membership.json"))
    assert membership["moved"]["reference"]["0"]["node"] == 0
    assert sorted(os.listdir(folder)) == [WEIGHTS_FILE]  # the torn file removed, never loaded
    kept = torch.load(os.path.join(folder, WEIGHTS_FILE), weights_only=True)
    assert kept["version"] == 2
    want = build_model("", MODEL, 2).state_dict()
    assert sorted(kept["state"]) == sorted(want)
    assert all(torch.equal(kept["state"][k], want[k]) for k in want)
    logs = ""
    for where, _, files in os.walk(nodes.run_dir):
        for name in files:
            if name.endswith(".log") or name.endswith(".jsonl"):
                with open(os.path.join(where, name), errors="replace") as f:
                    logs += f.read()
    assert (
        f"reference[0]: loaded the weights it was last given, version 1, from "
        f"{os.path.join(folder, WEIGHTS_FILE)}" in logs
    ), nodes.logs()

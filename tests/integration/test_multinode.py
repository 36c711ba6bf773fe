"""A run over two simulated nodes: two torchrun processes on 127.0.0.1, ``--nnodes=2``.

Node 1 acts as another host: ``ASYNCRL_HOST_ID=node1`` in its torchrun environment (its
children inherit it), so no shared memory crosses the boundary and its replicas are reached
over tcp. The run is the hello example's roles with a program (written by the test) that sends
30 lines, stops at a gate file after 15, and writes a summary: the counter's ledger counts each
line once, so the result is exact (10 times the hello example's) only if no line was counted
twice or lost, across a restarted role or a restarted worker group. Where root and ``ip netns``
allow it, one test runs node 1 in a network namespace of its own (a veth pair, off the
loopback, so with Curve) and a mount namespace with its own /dev/shm; it skips, saying why,
elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.nodes import lose_node
from tests.helpers.waiting import wait_until

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
EXPECTED = [["the", 40], ["dog", 30], ["fox", 30]]
"""The hello example's top three words, for its three lines sent ten times each."""

PROGRAM = """\
import asyncio, json, os

from examples.hello.roles import Line, Words

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "the dog sleeps and the fox runs",
    "a fox is quick and a dog is lazy",
]


async def main(ctx):
    lines = [Line(i, TEXT[i % 3]) for i in range(30)]
    for start in range(0, 30, 5):
        async for _, words in ctx.roles["splitter"].map("split", lines[start:start + 5], Words):
            await ctx.roles["counter"].call("add", words)
        if start + 5 == 15:
            with open(os.path.join(ctx.run_dir, "progress"), "w") as f:
                f.write(str(ctx.incarnation))
            while not os.path.exists(ctx.config["gate"]):
                await asyncio.sleep(0.05)
    top = await ctx.roles["counter"].call("top", 3)
    with open(os.path.join(ctx.run_dir, "summary.json"), "w") as f:
        json.dump({"top": top}, f)
    return top
"""

MANIFEST = """\
run:
  name: twonodes
  program: {program}:main
  config: {{gate: {gate}}}
roles:
  splitter:
    class: examples.hello.roles:Splitter
    replicas: 2
    placement: {{node: 1}}
    supervision: {{backoff_initial_s: 0.05}}
  counter:
    class: examples.hello.roles:Counter
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class TwoNodes:
    """Two torchrun processes (node ranks 0 and 1) running ``asyncrl.launch`` on one
    manifest."""

    def __init__(self, tmp: str, extra: str = "", options: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.options = options or ("--agent-liveness=10", "--join-timeout=60")
        self.run_dir = os.path.join(tmp, "run")
        self.gate = os.path.join(tmp, "gate")
        program = os.path.join(tmp, "program.py")
        with open(program, "w") as f:
            f.write(PROGRAM)
        self.manifest = os.path.join(tmp, "manifest.yaml")
        with open(self.manifest, "w") as f:
            f.write(MANIFEST.format(program=program, gate=self.gate) + extra)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, master: str = "127.0.0.1", node1: list[str] | None = None) -> None:
        """Start both nodes; ``node1`` prefixes node 1's command (another namespace), which
        otherwise gets ``ASYNCRL_HOST_ID=node1``."""
        port = _free_port()
        for node in (0, 1):
            env = {**os.environ, "PYTHONPATH": ROOT}
            if node == 1 and node1 is None:
                env["ASYNCRL_HOST_ID"] = "node1"
            prefix = (node1 or []) if node == 1 else []
            out = open(os.path.join(self.tmp, f"node{node}.log"), "wb")  # noqa: SIM115
            self.procs.append(
                subprocess.Popen(
                    [
                        *prefix,
                        TORCHRUN,
                        "--nnodes=2",
                        "--nproc-per-node=1",
                        f"--node-rank={node}",
                        f"--master-addr={master}",
                        f"--master-port={port}",
                        "--max-restarts=1",
                        "--monitor-interval=0.1",
                        "-m",
                        "asyncrl.launch",
                        self.manifest,
                        "--run-dir",
                        self.run_dir,
                        *self.options,
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            out.close()

    def logs(self) -> str:
        text = []
        for node in (0, 1):
            with open(os.path.join(self.tmp, f"node{node}.log"), errors="replace") as f:
                text.append(f"--- node {node} ---\n" + f.read()[-6000:])
        return "\n".join(text)

    def path(self, node: int, *parts: str) -> str:
        base = self.run_dir if node == 0 else os.path.join(self.run_dir, f"node-{node}")
        return os.path.join(base, *parts)

    def wait(self, what: str, ready: Callable[[], bool], timeout: float = 60.0) -> None:
        wait_until(ready, timeout=timeout, what=what, output=self.logs)

    def finish(self, timeout: float = 90.0) -> list[int]:
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the launch did not end within {timeout:g} s\n{self.logs()}")
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def nodes(tmp_path: Any) -> Iterator[TwoNodes]:
    launch = TwoNodes(str(tmp_path))
    try:
        yield launch
    finally:
        launch.kill()


def _check_completed(nodes: TwoNodes) -> None:
    assert _json(nodes.path(0, "driver.json"))["result"] == EXPECTED
    assert _json(nodes.path(0, "report.json"))["status"] == "completed"
    assert _json(nodes.path(1, "report.json"))["status"] == "completed"
    assert _json(nodes.path(0, "summary.json")) == {"top": EXPECTED, "nodes": 2}


@pytest.mark.slow
def test_a_run_over_two_nodes_completes_with_its_roles_on_node_1(tmp_path: Any) -> None:
    """With CurveZMQ keys (security.curve_keys, relative to the manifest): every tcp socket
    between the nodes authenticates, and the run is the same."""
    from asyncrl.keys import generate

    generate(str(tmp_path / "keys"))
    launch = TwoNodes(str(tmp_path), extra="security: {curve_keys: keys}\n")
    try:
        _run_over_two_nodes(launch)
    finally:
        launch.kill()


async def _describe(endpoint: str, curve: Any, secret: str | None = None) -> Any:
    """What the replica at ``endpoint`` says of itself, asked with ``curve`` keys (or none) and
    the run's ``secret``."""
    from asyncrl.transport import ChannelOptions, Client

    client = Client(endpoint, options=ChannelOptions(run="twonodes"), curve=curve, secret=secret)
    try:
        await client.connect(timeout=3.0)
        return await client.call("_describe", None, timeout=3.0)
    finally:
        await client.close()


def _run_over_two_nodes(nodes: TwoNodes) -> None:
    import asyncio

    from asyncrl.transport import TransportError, load_keys
    from asyncrl.transport.control import read_secret

    nodes.start()
    nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress")))
    tcp = _json(nodes.path(1, "specs", "splitter.0.0.json"))["tcp_endpoint"]
    keys = load_keys(os.path.join(nodes.tmp, "keys"))
    secret = read_secret(nodes.path(0, "secret"))  # node 0 made it; node 1's roles require it
    assert asyncio.run(_describe(tcp, keys, secret))["role"] == "splitter"
    with pytest.raises(TransportError):
        asyncio.run(_describe(tcp, False, secret))  # no keys: refused before any message
    with open(nodes.gate, "w"):
        pass
    assert nodes.finish() == [0, 0], nodes.logs()
    _check_completed(nodes)
    splitters = [_json(nodes.path(1, "registry", f"splitter.{i}.json")) for i in (0, 1)]
    assert [s["endpoint"].startswith("ipc://") for s in splitters] == [True, True]
    spec = _json(nodes.path(0, "specs", "driver.0.0.json"))
    tcp = spec["groups"]["splitter"]["endpoints"]
    assert [ep.startswith("tcp://127.0.0.1:") for ep in tcp] == [True, True]
    assert spec["groups"]["counter"]["endpoints"][0].startswith("ipc://")
    seen_from_1 = _json(nodes.path(1, "specs", "splitter.0.0.json"))
    assert seen_from_1["groups"]["counter"]["endpoints"][0].startswith("tcp://127.0.0.1:")
    assert seen_from_1["groups"]["splitter"]["endpoints"][0].startswith("ipc://")
    assert seen_from_1["tcp_endpoint"] == tcp[0]
    assert seen_from_1["curve_keys"] == os.path.join(nodes.tmp, "keys")
    assert spec["curve_keys"] == os.path.join(nodes.tmp, "keys")
    assert not os.path.exists(nodes.path(1, "registry", "counter.0.json"))
    assert _json(nodes.path(1, "launch.json"))["attempt"] == 0


@pytest.mark.slow
def test_a_role_killed_on_node_1_is_restarted_there_and_the_run_completes(
    nodes: TwoNodes,
) -> None:
    nodes.start()
    nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress")))
    entry = nodes.path(1, "registry", "splitter.0.json")
    # the gate can open before node 1's agent has registered its replica: wait for the entry
    nodes.wait("splitter[0] registered on node 1", lambda: _json(entry) is not None)
    victim = _json(entry)
    os.kill(victim["pid"], signal.SIGKILL)
    nodes.wait("splitter[0] restarted", lambda: (_json(entry) or {}).get("incarnation") == 1)
    with open(nodes.gate, "w"):
        pass
    assert nodes.finish() == [0, 0], nodes.logs()
    _check_completed(nodes)
    node1 = _json(nodes.path(1, "report.json"))
    assert node1["restarts"] == {"splitter": 1}
    whole = _json(nodes.path(0, "report.json"))  # node 0's covers every node
    assert whole["restarts"] == {"counter": 0, "driver": 0, "splitter": 1}
    assert whole["served"]["splitter"] == node1["served"]["splitter"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_an_agent_killed_torchrun_restarts_the_group_and_the_run_resumes(
    tmp_path: Any, victim: int
) -> None:
    """Node 1's agent: its restarted worker finds the attempt joined, node 0 ends it. Node 0's
    agent (and the driver with it): its restarted worker starts the next attempt, node 1 sees it.
    Either way both nodes move to attempt 1, and the program resumes (the counter's ledger
    refuses the lines it counted before). The agent liveness is long enough that torchrun
    restarts the worker before node 0 could take node 1 as lost (then it would join the running
    attempt instead: tests/integration/test_node_loss.py)."""
    nodes = TwoNodes(str(tmp_path), options=("--agent-liveness=90", "--join-timeout=60"))
    try:
        _agent_killed(nodes, victim)
    finally:
        nodes.kill()


def _agent_killed(nodes: TwoNodes, victim: int) -> None:
    nodes.start()
    nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress")))
    agent = _json(nodes.path(victim, "launch.json"))
    assert agent["attempt"] == 0
    os.kill(agent["pid"], signal.SIGKILL)

    def both_in_attempt_1() -> bool:
        return all((_json(nodes.path(n, "launch.json")) or {}).get("attempt") == 1 for n in (0, 1))

    nodes.wait("both nodes in attempt 1", both_in_attempt_1, timeout=90)
    with open(nodes.gate, "w"):
        pass
    assert nodes.finish() == [0, 0], nodes.logs()
    _check_completed(nodes)
    why = {1: "the agent of node 1 restarted", 0: "node 0 started attempt 1: its agent restarted"}[
        victim
    ]
    survivor = os.path.join(nodes.tmp, f"node{1 - victim}.log")
    with open(survivor) as f:
        assert f"{why}; exiting so that torchrun starts the group again" in f.read()


@pytest.mark.slow
def test_a_node_lost_for_good_with_every_replica_of_a_role_fails_the_run_naming_it(
    tmp_path: Any,
) -> None:
    """Node 1's torchrun and everything under it killed: node 0 sees no heartbeat and marks it
    lost, the run goes on without it (tests/integration/test_node_loss.py), but both splitters
    were on node 1 and none is left, so the program's next call fails naming the lost node,
    and so does the run, at once rather than after a restart and the join timeout."""
    nodes = TwoNodes(str(tmp_path), options=("--agent-liveness=3", "--join-timeout=60"))
    try:
        nodes.start()
        nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress")))
        # Node 1's splitters gone before the program sends its next line, not after.
        lose_node(nodes.procs[1], nodes.path(1))
        with open(nodes.gate, "w"):
            pass
        try:
            code = nodes.procs[0].wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 0 did not end the run\n{nodes.logs()}")
        assert code == 1, nodes.logs()
        with open(os.path.join(nodes.tmp, "node0.log")) as f:
            log = f.read()
        assert "the agent of node 1 sent no heartbeat for " in log
        assert "node 1 is lost; the run goes on without it" in log
        error = _json(nodes.path(0, "driver.json"))["error"]
        assert "replica 0: its node 1 was lost; replica 1: its node 1 was lost" in error
    finally:
        nodes.kill()


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (name, our address, its address).

    Skips, with the reason, where the machine does not allow it (not root, no ``ip`` or
    ``unshare``, no permission to create namespaces or links).
    """
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"a network namespace needs {' and '.join(missing)}, not installed")
    tag = f"{os.getpid() % 100000}"
    name, here, there = f"asyncrl-t{tag}", f"vA{tag}", f"vB{tag}"
    net = f"10.213.{os.getpid() % 200 + 20}"
    try:
        _sh("ip", "netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace: {getattr(exc, 'stderr', exc)!r}")

    def remove() -> None:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    inside = ("ip", "netns", "exec", name)
    try:
        _sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _sh("ip", "link", "set", there, "netns", name)
        _sh("ip", "addr", "add", f"{net}.1/30", "dev", here)
        _sh("ip", "link", "set", here, "up")
        _sh(*inside, "ip", "addr", "add", f"{net}.2/30", "dev", there)
        _sh(*inside, "ip", "link", "set", there, "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        remove()
        pytest.skip(f"cannot join a network namespace to this one: {exc.stderr!r}")
    try:
        yield name, f"{net}.1", f"{net}.2"
    finally:
        remove()


@pytest.mark.slow
def test_node_1_in_its_own_network_and_mount_namespace(
    tmp_path: Any, namespace: tuple[str, str, str]
) -> None:
    """Node 1 as a host of its own: another network stack (reached over a veth pair, off the
    loopback, so only with Curve) and its own /dev/shm (a private mount namespace)."""
    from asyncrl.keys import generate

    name, here, there = namespace
    generate(str(tmp_path / "keys"))
    nodes = TwoNodes(str(tmp_path), extra="security: {curve_keys: keys}\n")
    with open(nodes.gate, "w"):
        pass
    own_shm = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    private = ["unshare", "--mount", "--propagation", "private", "sh", "-c", own_shm, "sh"]
    try:
        nodes.start(master=here, node1=["ip", "netns", "exec", name, *private])
        assert nodes.finish() == [0, 0], nodes.logs()
        _check_completed(nodes)
        driver = _json(nodes.path(0, "specs", "driver.0.0.json"))
        assert [ep.split(":")[1] for ep in driver["groups"]["splitter"]["endpoints"]] == [
            f"//{there}",
            f"//{there}",
        ]
        splitter = _json(nodes.path(1, "specs", "splitter.0.0.json"))
        assert splitter["groups"]["counter"]["endpoints"][0].startswith(f"tcp://{here}:")
    finally:
        nodes.kill()


# -- the launch's pieces, in-process (fast) ------------------------------------------------------


def test_launch_env_reads_what_torchrun_sets_and_names_what_is_missing() -> None:
    from asyncrl.supervision.multinode import LaunchEnv

    env = {
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "LOCAL_WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    assert LaunchEnv.from_environ(env) == LaunchEnv(1, 2, "10.0.0.1", 29500, "", True)
    assert LaunchEnv.from_environ({**env, "TORCHELASTIC_RUN_ID": "job7"}).run_id == "job7"
    with pytest.raises(ValueError) as info:
        LaunchEnv.from_environ({"GROUP_RANK": "0", "MASTER_PORT": "1"})
    assert str(info.value).startswith(
        "GROUP_WORLD_SIZE, MASTER_ADDR not set: asyncrl.launch runs under torchrun"
    )
    with pytest.raises(ValueError) as info:
        LaunchEnv.from_environ({**env, "LOCAL_WORLD_SIZE": "4"})
    assert "pass --nproc-per-node=1" in str(info.value)


def test_launch_outside_torchrun_says_how_to_start_it(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncrl.supervision.multinode import main

    for var in ("GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert var not in os.environ
    assert main(["examples/hello/manifest.yaml"]) == 2
    assert "asyncrl.launch runs under torchrun" in capsys.readouterr().err


def test_node_address_routes_to_the_master_and_never_binds_everything_unasked() -> None:
    from asyncrl.supervision.store_registry import node_address

    assert node_address("", "127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    assert node_address("0.0.0.0", "127.0.0.1") == ("0.0.0.0", "127.0.0.1")
    assert node_address("10.1.2.3", "127.0.0.1") == ("10.1.2.3", "10.1.2.3")
    assert node_address("lo", "127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(ValueError) as info:
        node_address("nosuchif0", "127.0.0.1")
    assert str(info.value).startswith(
        "network.address: 'nosuchif0' is neither an IP address nor a network interface"
    )


def test_free_ports_are_distinct_and_bindable() -> None:
    from asyncrl.supervision.store_registry import free_ports

    ports = free_ports("127.0.0.1", 5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_launch_keys_keep_each_attempt_apart() -> None:
    from asyncrl.supervision.store_registry import LaunchKeys

    keys = LaunchKeys("job7")
    assert keys.prefix(2) == "asyncrl/job7/2"
    assert keys.endpoints(2, 1) == "asyncrl/job7/2/endpoints/1"
    assert keys.stop(0) != keys.stop(1)
    assert keys.final == "asyncrl/job7/final"


def test_store_client_against_a_real_tcpstore() -> None:
    import asyncio

    from asyncrl.supervision.store_registry import StoreClient, StoreError

    async def scenario() -> None:
        master = StoreClient("127.0.0.1", _free_port(), is_master=True, timeout_s=5)
        await master.connect()
        client = StoreClient("127.0.0.1", master.port, timeout_s=5)
        await client.connect()
        assert await client.peek("a") is None
        assert await client.set_once("a", "first") == "first"
        assert await master.set_once("a", "second") == "first"
        assert await client.add("n", 1) == 1
        assert await master.add("n", 1) == 2
        await master.set("k", "v")
        await client.wait_for(["a", "k"], 1.0)
        assert await client.get("k") == "v"
        with pytest.raises(StoreError) as info:
            await client.wait_for(["a", "missing"], 0.3, why="a test waits")
        assert str(info.value) == (
            f"waited 0.3 s for missing in the store at 127.0.0.1:{master.port}: a test waits"
        )

    asyncio.run(scenario())


def test_an_unreachable_store_names_the_torchrun_options() -> None:
    import asyncio

    from asyncrl.supervision.store_registry import StoreClient, StoreError

    port = _free_port()
    client = StoreClient("127.0.0.1", port, timeout_s=0.5)
    with pytest.raises(StoreError) as info:
        asyncio.run(client.connect())
    assert str(info.value).startswith(f"cannot reach torchrun's store at 127.0.0.1:{port} (")
    assert "check --master-addr/--master-port (or --rdzv-endpoint)" in str(info.value)

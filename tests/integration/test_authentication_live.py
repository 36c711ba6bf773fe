"""A process outside the run cannot call a real learner: ``train_step`` with invented samples and
``checkpoint`` with an invented resume position are refused before they are served, and change
nothing; a client pointed at the run's secret file is served.

Before, any process of the user could call them: the learner trained on ``evil0..7`` (version
0 to 1) and the program's resume position became ``{"phase": "pwned"}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from typing import Any

import msgpack
import pytest
import zmq

from asyncrl.transport import ChannelOptions, Client, RemoteError
from asyncrl.transport.control import SECRET_FILE_ENV, read_secret
from tests.conftest import ROOT
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

PROGRAM = """\
import asyncio, os


async def main(ctx):
    open(os.path.join(ctx.run_dir, "ready"), "w").close()
    while not os.path.exists(os.path.join(ctx.run_dir, "gate")):
        await asyncio.sleep(0.05)
    status = await ctx.roles["learner"].call("status", None)
    return {k: status[k] for k in ("version", "step", "consumed", "keep")}
"""

MANIFEST = """\
run: {{name: guarded, program: {program}:main}}
roles:
  learner:
    class: asyncrl.roles.training.learner:Learner
    threads: 1
    config:
      model_config: {{model_type: gpt2, vocab_size: 14, n_positions: 16, n_embd: 16,
                     n_layer: 1, n_head: 2, bos_token_id: 1, eos_token_id: 1, pad_token_id: 0}}
      tokenizer_path: examples/arith/tokenizer
      algorithm: bc
      seed: 0
"""


def _evil_batch() -> dict[str, Any]:
    """A TrainBatch of invented samples, as msgpack maps."""
    samples = [
        {
            "sample": {
                "prompt_id": f"evil{i}",
                "sample_index": 0,
                "prompt_ids": [2, 3],
                "token_ids": [4, 5, 1],
                "logprobs": [0.0, 0.0, 0.0],
                "versions": [0, 0, 0],
                "finished": True,
                "stop_reason": "eos",
            },
            "reward": 1.0,
        }
        for i in range(8)
    ]
    return {"samples": samples, "algorithm": "bc", "keep": {"phase": "pwned", "cursor": 1e9}}


def attack(endpoint: str) -> list[Any]:
    """What a process outside the run gets back for train_step and checkpoint (ERROR payloads,
    or replies), sent as docs/protocol.md says, without a handshake and after one without the
    secret."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    keep = {"phase": "pwned", "cursor": 1e9}
    out = []
    try:
        for message in (
            [1, 3, 1, "train_step", 0.0, 0, 0, "", _evil_batch(), []],
            [1, 3, 2, "checkpoint", 0.0, 0, 0, "", keep, []],
            [1, 1, 3, "", 0.0, 0, 0, "", {"version": 1, "name": "intruder"}],
            [1, 3, 4, "train_step", 0.0, 0, 0, "", _evil_batch(), []],
            [1, 3, 5, "checkpoint", 0.0, 0, 0, "", keep, []],
        ):
            sock.send(msgpack.packb(message))
            while True:
                assert sock.poll(60_000), f"no answer to {message[3] or 'HANDSHAKE'}"
                env = msgpack.unpackb(sock.recv(), strict_map_key=False)
                if env[2] == message[2] and env[1] in (2, 4, 5):
                    out.append([env[1], env[8]])
                    break
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


async def _status_with_the_secret_file(endpoint: str, secret_file: str) -> Any:
    os.environ[SECRET_FILE_ENV] = secret_file  # as a tool pointed at the run would be
    try:
        async with Client(endpoint, name="tool", options=ChannelOptions(shm=False)) as tool:
            return await tool.call("status", None, timeout=30)
    finally:
        del os.environ[SECRET_FILE_ENV]


async def _connect_without_the_secret(endpoint: str) -> str:
    client = Client(endpoint, name="intruder", options=ChannelOptions(shm=False))
    try:
        await client.connect(timeout=30)
    except RemoteError as exc:
        return str(exc)
    finally:
        await client.close()
    return "connected"


def test_a_learner_refuses_calls_from_outside_the_run(run_dir: str) -> None:
    program = os.path.join(run_dir, "flow.py")
    with open(program, "w") as f:
        f.write(PROGRAM)
    manifest = os.path.join(run_dir, "m.yaml")
    with open(manifest, "w") as f:
        f.write(MANIFEST.format(program=program))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            manifest,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "ASYNCRL_CONSOLE": "0"},
    )
    try:
        ready = os.path.join(run_dir, "ready")
        wait_until(lambda: os.path.exists(ready), proc=proc, what=ready, timeout=120)
        endpoint = f"ipc://{run_dir}/sockets/learner.0"
        answers = attack(endpoint)
        refused = asyncio.run(_connect_without_the_secret(endpoint))
        secret_file = os.path.join(run_dir, "secret")
        assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
        assert len(read_secret(secret_file)) == 32
        status = asyncio.run(_status_with_the_secret_file(endpoint, secret_file))
        with open(os.path.join(run_dir, "gate"), "w"):
            pass
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    how = (
        "run it inside the run (every process the node agent starts has ASYNCRL_SECRET_FILE), "
        "or point it at the run's secret file: ASYNCRL_SECRET_FILE=RUN_DIR/secret"
    )
    unadmitted = (
        "REQUEST refused: learner.0 serves only the processes of its run, and this client has "
        f"not presented the run's secret in a HANDSHAKE (Hello.secret) on this connection; {how}"
    )
    error = {"code": "unauthorized", "message": unadmitted}
    no_secret = {
        "code": "unauthorized",
        "message": "learner.0 serves only the processes of its run, and the HANDSHAKE of "
        f"intruder presented no secret (Hello.secret); {how}",
    }
    assert answers == [[5, error], [5, error], [5, no_secret], [5, error], [5, error]]
    assert refused == f"error reply from {endpoint} [unauthorized]: {no_secret['message']}"
    assert (status["version"], status["step"], status["consumed"]) == (0, 0, 0)
    with open(os.path.join(run_dir, "driver.json")) as f:
        result = json.load(f)["result"]
    assert result == {"version": 0, "step": 0, "consumed": 0, "keep": {}}
    for root, _, names in os.walk(run_dir):  # the step log, checkpoints, every log
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            assert b"evil" not in data and b"pwned" not in data, name

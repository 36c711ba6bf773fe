"""A test server in its own process: ``python -m tests.helpers.echo_server ENDPOINT [options]``.

Prints ``READY <bound endpoint> <pid>`` on stdout once it serves, then serves until SIGTERM,
SIGINT or a STOP message. Methods:

- ``echo``: returns the payload unchanged (any msgpack value, tensors included);
- ``add``: ``{"a": int, "b": int}`` -> ``a + b``;
- ``sum``: a tensor -> the float sum of its elements;
- ``fail``: raises ValueError with the payload as message;
- ``sleep``: sleeps ``payload`` seconds on the loop (async), then returns it;
- ``block``: blocks the event loop for ``payload`` seconds (a bug a heartbeat must notice).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import msgspec
import torch

from asyncrl.transport import ChannelOptions, Server, run


class AddArgs(msgspec.Struct):
    a: int
    b: int


def echo(payload: Any, call: Any) -> Any:
    return payload


def add(payload: AddArgs, call: Any) -> int:
    return payload.a + payload.b


def tensor_sum(payload: torch.Tensor, call: Any) -> float:
    return float(payload.double().sum())


def fail(payload: Any, call: Any) -> Any:
    raise ValueError(str(payload))


async def sleep(payload: float, call: Any) -> float:
    await asyncio.sleep(payload)
    return payload


def block(payload: float, call: Any) -> float:
    time.sleep(payload)
    return payload


async def main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    options = ChannelOptions(
        run=args.run,
        shm=not args.no_shm,
        heartbeat_interval_s=args.interval,
        max_message_bytes=args.max_message_bytes,
    )
    server = Server(
        args.endpoint, name="echo", incarnation=args.incarnation, options=options, on_stop=stop.set
    )
    server.add("echo", echo)
    server.add("add", add, AddArgs)
    server.add("sum", tensor_sum, torch.Tensor)
    server.add("fail", fail)
    server.add("sleep", sleep, float)
    server.add("block", block, float)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        print(f"READY {server.endpoint} {__import__('os').getpid()}", flush=True)
        await stop.wait()
    print(f"STATS {dict(server.stats)}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--run", default="test")
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--no-shm", action="store_true")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--max-message-bytes", type=int, default=1 << 31)
    run(main(parser.parse_args()))
    sys.exit(0)

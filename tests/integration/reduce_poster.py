"""A poster in its own process: ``python -m tests.integration.reduce_poster ENDPOINT NAME``.

Connects a ``Poster`` to the reducer server at ENDPOINT and prints ``READY <pid>``. Then it reads
commands from stdin, one JSON object a line:

- ``{"post": [[key, part, expected, [values...]], ...]}``: posts those contributions (each with
  the moments of its values), waits until all are acknowledged, and prints ``ACKED <stats>``,
  the poster's counters as JSON;
- ``{"exit": true}`` or end of input: closes the poster and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from asyncrl.post import Contribution, Poster
from asyncrl.reduce import Moments
from asyncrl.transport import ChannelOptions, run


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    options = ChannelOptions(run=args.run)
    poster = Poster(
        args.endpoint,
        name=args.name,
        timeout_s=args.timeout_s,
        retry_s=args.retry_s,
        options=options,
    )
    await poster.connect()
    _say(f"READY {os.getpid()}")
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            command = json.loads(line)
            if command.get("exit"):
                break
            for key, part, expected, values in command["post"]:
                poster.post(Contribution(key, part, Moments.of(values), expected, args.name))
            await poster.flush(args.flush_s)
            _say("ACKED " + json.dumps(dict(poster.stats), sort_keys=True))
    finally:
        await poster.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("endpoint")
    parser.add_argument("name")
    parser.add_argument("--run", default="reduce")
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--retry-s", type=float, default=0.1)
    parser.add_argument("--flush-s", type=float, default=60.0)
    run(main(parser.parse_args()))

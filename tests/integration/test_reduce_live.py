"""Split-mode reduction across processes: posters in their own processes, a reducer served here.

Each test serves a ``Reducer`` on an ipc endpoint from this process and runs poster processes
(``tests/integration/reduce_poster.py``). One poster, ``f``, is frozen with SIGSTOP after its
first batch, so the rounds that need its second batch meet their deadline without it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

from asyncrl.post import Contribution, serve_reducer
from asyncrl.reduce import Moments, Outcome, Reducer, Released, Straggler
from asyncrl.transport import ChannelOptions, Server, run

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 10.0
DEADLINE_S = 0.3
LONG_S = 60.0  # the deadline of rounds that must complete: never reached in a passing test
OPTIONS = ChannelOptions(run="reduce")

Part = tuple[str, str, int, list[float]]  # key, part, expected, values


def part(key: str, name: str, expected: int, n: int = 3) -> Part:
    rnd = random.Random(f"{key}/{name}")
    return (key, name, expected, [rnd.uniform(-10.0, 10.0) for _ in range(n)])


class Child:
    """A poster process. Its stdout is read on the loop, so waiting for it never blocks the server
    this process runs."""

    def __init__(self, endpoint: str, name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.reduce_poster", endpoint, name],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._readable)
        self._reading = True
        self._buf = b""
        self._lines: asyncio.Queue[str] = asyncio.Queue()

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self._stop_reading()
            self._lines.put_nowait("")
            return
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            self._lines.put_nowait(line.decode())

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    async def line(self) -> str:
        line = await asyncio.wait_for(self._lines.get(), WAIT_S)
        if not line:
            raise AssertionError(f"poster {self.name} exited with {self.proc.wait(WAIT_S)}")
        return line

    async def ready(self) -> None:
        line = await self.line()
        assert line == f"READY {self.proc.pid}", line

    def post(self, parts: Iterable[Part]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"post": list(parts)}) + "\n").encode())
        self.proc.stdin.flush()

    async def acked(self) -> Counter[str]:
        """The poster's counters once everything it was told to post is acknowledged."""
        word, stats = (await self.line()).split(" ", 1)
        assert word == "ACKED"
        return Counter(json.loads(stats))

    async def exit(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b'{"exit": true}\n')
        self.proc.stdin.flush()
        while await asyncio.wait_for(self._lines.get(), WAIT_S):
            pass  # reports nobody waited for, up to the end of its output
        return self.proc.wait(WAIT_S)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self._stop_reading()
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too
        self.proc.wait(WAIT_S)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


class Releases:
    """What the reducer released and refused, with a wait for the next release."""

    def __init__(self) -> None:
        self.all: list[Released] = []
        self.late: list[tuple[str, str]] = []
        self._queue: asyncio.Queue[Released] = asyncio.Queue()

    def __call__(self, r: Released) -> None:
        self.all.append(r)
        self._queue.put_nowait(r)

    def on_late(self, key: str, part: str) -> None:
        self.late.append((key, part))

    async def take(self, count: int) -> dict[str, Released]:
        got = [await asyncio.wait_for(self._queue.get(), WAIT_S) for _ in range(count)]
        return {r.key: r for r in got}


def check_moments(r: Released, parts: list[Part]) -> None:
    """The released moments are those of the values of exactly the parts it says it merged."""
    values = [v for key, name, _, vs in parts if key == r.key and name in r.parts for v in vs]
    want = Moments.of(values)
    assert r.moments.count == want.count
    assert math.isclose(r.moments.mean, want.mean, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(r.moments.var, want.var, rel_tol=1e-9, abs_tol=1e-12)


async def serve(endpoint: str, handler: Any, *, incarnation: int = 0, **kw: Any) -> Server:
    server = Server(endpoint, options=OPTIONS, incarnation=incarnation, **kw)
    server.add("contribute", handler, Contribution)
    await server.start()
    return server


async def start(endpoint: str, names: str, children: list[Child]) -> list[Child]:
    started = [Child(endpoint, name) for name in names]
    children += started
    for child in started:
        await child.ready()
    return started


# Rounds c0, c1 need posters a and b; c2 needs a and f's first batch: all complete in time.
INDEPENDENT = [
    part("c0", "a", 2),
    part("c0", "b", 2),
    part("c1", "a", 2),
    part("c1", "b", 2),
    part("c2", "a", 2),
]
F_FIRST = [part("c2", "f", 2)]


async def freeze_f_after_its_first_batch(reducer: Reducer, a: Child, b: Child, f: Child) -> None:
    for key in ("c0", "c1", "c2"):
        reducer.open(key, 2, deadline_s=LONG_S)
    f.post(F_FIRST)
    assert (await f.acked())["merged"] == 1
    f.signal(signal.SIGSTOP)


def test_emit_releases_rounds_without_the_frozen_poster_partial(run_dir: str) -> None:
    # e0: a and b in time, f late. e1: only a in time (under k_min), so it waits for f's first
    # part, the k_min-th, and is released partial with it; f's second part is late.
    a_parts = [*(p for p in INDEPENDENT if p[1] == "a"), part("e1", "a", 3), part("e0", "a", 3)]
    b_parts = [*(p for p in INDEPENDENT if p[1] == "b"), part("e0", "b", 3)]
    f_second = [part("e1", "f1", 3), part("e1", "f2", 3), part("e0", "f", 3)]
    everything = [*a_parts, *b_parts, *F_FIRST, *f_second]

    async def main() -> None:
        endpoint = f"ipc://{run_dir}/reducer"
        got = Releases()
        reducer = Reducer(
            got, policy=Straggler.EMIT, deadline_s=DEADLINE_S, k_min=2, on_late=got.on_late
        )
        server = await serve(endpoint, serve_reducer(reducer))
        children: list[Child] = []
        try:
            a, b, f = await start(endpoint, "abf", children)
            await freeze_f_after_its_first_batch(reducer, a, b, f)
            reducer.open("e1", 3)  # before e0, so that its deadline passes first
            reducer.open("e0", 3)
            f.post(f_second)  # read once f runs again
            a.post(a_parts)
            b.post(b_parts)
            assert (await a.acked())["merged"] == len(a_parts)
            assert (await b.acked())["merged"] == len(b_parts)
            first = await got.take(4)  # e0 is released at its deadline or later: e1's passed
            assert {k: r.outcome for k, r in first.items()} == {
                "c0": Outcome.COMPLETE,
                "c1": Outcome.COMPLETE,
                "c2": Outcome.COMPLETE,
                "e0": Outcome.PARTIAL,
            }
            assert first["e0"].parts == {"a", "b"}
            assert first["c2"].parts == {"a", "f"}
            assert reducer.pending() == ["e1"]
            assert reducer.metrics["overdue"] == 1

            f.signal(signal.SIGCONT)
            stats = await f.acked()
            assert (stats["merged"], stats["refused"]) == (2, 2)
            (e1,) = (await got.take(1)).values()
            assert (e1.key, e1.outcome, e1.parts, e1.expected) == (
                "e1",
                Outcome.PARTIAL,
                frozenset({"a", "f1"}),
                3,
            )
            assert got.late == [("e1", "f2"), ("e0", "f")]
            for r in got.all:
                check_moments(r, everything)
            m = reducer.metrics
            assert (m["complete"], m["partial"], m["late"], m["duplicates"]) == (3, 2, 2, 0)
            assert m["open_rounds"] == 0
            for child in children:
                assert await child.exit() == 0
        finally:
            for child in children:
                child.kill()
            reducer.close()
            await server.close()

    run(main())


def test_drop_drops_rounds_that_wait_for_the_frozen_poster(run_dir: str) -> None:
    a_parts = [*(p for p in INDEPENDENT if p[1] == "a"), part("d0", "a", 2)]
    b_parts = [p for p in INDEPENDENT if p[1] == "b"]
    f_second = [part("d0", "f", 2)]

    async def main() -> None:
        endpoint = f"ipc://{run_dir}/reducer"
        got = Releases()
        reducer = Reducer(got, policy=Straggler.DROP, deadline_s=DEADLINE_S, on_late=got.on_late)
        server = await serve(endpoint, serve_reducer(reducer))
        children: list[Child] = []
        try:
            a, b, f = await start(endpoint, "abf", children)
            await freeze_f_after_its_first_batch(reducer, a, b, f)
            f.post(f_second)
            a.post(a_parts)
            b.post(b_parts)
            released = await got.take(4)
            assert {k: r.outcome for k, r in released.items()} == {
                "c0": Outcome.COMPLETE,
                "c1": Outcome.COMPLETE,
                "c2": Outcome.COMPLETE,
                "d0": Outcome.DROPPED,
            }
            assert released["d0"].parts == {"a"}
            assert released["d0"].waited_s >= DEADLINE_S - 0.01
            for r in got.all:
                check_moments(r, [*a_parts, *b_parts, *F_FIRST])

            f.signal(signal.SIGCONT)
            stats = await f.acked()
            assert (stats["merged"], stats["refused"]) == (1, 1)
            assert got.late == [("d0", "f")]
            m = reducer.metrics
            assert (m["complete"], m["dropped"], m["late"], m["open_rounds"]) == (3, 1, 1, 0)
            for child in children:
                assert await child.exit() == 0
        finally:
            for child in children:
                child.kill()
            reducer.close()
            await server.close()

    run(main())


def test_wait_holds_the_round_until_the_frozen_poster_runs_again(run_dir: str) -> None:
    a_parts = [*(p for p in INDEPENDENT if p[1] == "a"), part("w0", "a", 2)]
    b_parts = [p for p in INDEPENDENT if p[1] == "b"]
    f_second = [part("w0", "f", 2)]

    async def main() -> None:
        endpoint = f"ipc://{run_dir}/reducer"
        got = Releases()
        reducer = Reducer(got, policy=Straggler.WAIT, deadline_s=DEADLINE_S, on_late=got.on_late)
        server = await serve(endpoint, serve_reducer(reducer))
        children: list[Child] = []
        try:
            a, b, f = await start(endpoint, "abf", children)
            await freeze_f_after_its_first_batch(reducer, a, b, f)
            f.post(f_second)
            a.post(a_parts)
            b.post(b_parts)
            await a.acked()  # w0 is open from here on
            released = await got.take(3)
            assert {k: r.outcome for k, r in released.items()} == dict.fromkeys(
                ("c0", "c1", "c2"), Outcome.COMPLETE
            )
            await asyncio.sleep(DEADLINE_S + 0.1)  # w0's deadline has to pass
            assert reducer.pending() == ["w0"]
            assert reducer.metrics["overdue"] == 1

            f.signal(signal.SIGCONT)
            (w0,) = (await got.take(1)).values()
            assert (w0.key, w0.outcome, w0.parts) == ("w0", Outcome.COMPLETE, frozenset({"a", "f"}))
            assert w0.waited_s >= DEADLINE_S + 0.1
            for r in got.all:
                check_moments(r, [*a_parts, *b_parts, *F_FIRST, *f_second])
            assert (await f.acked())["merged"] == 2
            m = reducer.metrics
            assert (m["complete"], m["overdue"], m["late"], m["open_rounds"]) == (4, 1, 0, 0)
            for child in children:
                assert await child.exit() == 0
        finally:
            for child in children:
                child.kill()
            reducer.close()
            await server.close()

    run(main())


def test_contributions_survive_a_server_restart_and_count_once(run_dir: str) -> None:
    keys = [f"r{i}" for i in range(4)]
    a_parts = [part(k, "a", 2) for k in keys]
    b_parts = [part(k, "b", 2) for k in keys]

    async def main() -> None:
        endpoint = f"ipc://{run_dir}/reducer"
        got = Releases()
        reducer = Reducer(got, on_late=got.on_late)
        contribute = serve_reducer(reducer)
        first_merged = asyncio.Event()

        async def merge_and_withhold_the_ack(payload: Any, call: Any) -> bool:
            contribute(payload, call)
            if reducer.metrics["contributions"] == len(a_parts):
                first_merged.set()
            await asyncio.Event().wait()  # the server goes down before it answers
            return True

        servers = [await serve(endpoint, merge_and_withhold_the_ack)]
        children: list[Child] = []
        try:
            a, b = await start(endpoint, "ab", children)
            a.post(a_parts)
            await asyncio.wait_for(first_merged.wait(), WAIT_S)
            assert got.all == [] and reducer.pending() == keys
            await servers[0].close()

            servers.append(await serve(endpoint, contribute, incarnation=1))
            # a re-sends once it is connected to the new incarnation; the rounds are still open,
            # so its parts are duplicates, and acknowledged as such.
            stats_a = await a.acked()
            assert got.all == [] and reducer.metrics["duplicates"] == len(a_parts)
            b.post(b_parts)
            stats_b = await b.acked()
            released = await got.take(len(keys))
            assert sorted(released) == keys
            assert len(got.all) == len(keys)  # each round released once
            for r in got.all:
                assert (r.outcome, r.parts) == (Outcome.COMPLETE, frozenset({"a", "b"}))
                check_moments(r, [*a_parts, *b_parts])
            # a's contributions were merged by the first server and acknowledged by the second.
            assert (stats_a["merged"], stats_a["refused"], stats_a["acked"]) == (0, 4, 4)
            assert stats_a["resends"] >= 4
            assert (stats_b["merged"], stats_b["acked"]) == (4, 4)
            m = reducer.metrics
            assert (m["complete"], m["contributions"], m["duplicates"], m["late"]) == (4, 8, 4, 0)
            assert got.late == []
            for child in children:
                assert await child.exit() == 0
        finally:
            for child in children:
                child.kill()
            reducer.close()
            for server in servers:
                await server.close()

    run(main())

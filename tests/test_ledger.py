"""The ledger: each id is taken once, across reopening the file, and a torn last line is cut."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from asyncrl.ledger import Ledger
from asyncrl.role import RoleContext
from examples.hello.roles import Counter, Words


def lines(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        return f.read().splitlines(keepends=True)


def test_an_id_is_taken_once_and_still_refused_after_reopening(tmp_path: Path) -> None:
    path = os.path.join(tmp_path, "deep", "seen.jsonl")  # its directory is made
    ledger = Ledger(path)
    assert ledger.add(1) and ledger.add("p7") and ledger.add(["p7", 2])
    assert not ledger.add(1) and not ledger.add(("p7", 2))  # a tuple is the same id as a list
    ledger.close()
    again = Ledger(path, fsync=True)
    assert (len(again), set(again)) == (3, {1, "p7", ("p7", 2)})
    assert 1 in again and ["p7", 2] in again and 2 not in again
    assert not again.add("p7")
    assert again.add(3)
    again.close()
    assert lines(path) == [b"1\n", b'"p7"\n', b'["p7",2]\n', b"3\n"]


def test_values_are_kept_with_their_ids_and_read_back_in_order(tmp_path: Path) -> None:
    path = os.path.join(tmp_path, "seen.jsonl")
    ledger = Ledger(path)
    assert ledger.add(0, ["the", "fox"])
    assert ledger.add(["p", 1])  # no value
    assert not ledger.add(0, ["something", "else"])  # a duplicate: its value is not written
    assert list(ledger.items()) == [(0, ["the", "fox"]), (["p", 1], None)]
    ledger.close()
    assert lines(path) == [b'{"id":0,"value":["the","fox"]}\n', b'["p",1]\n']
    again = Ledger(path)
    assert list(again.items()) == [(0, ["the", "fox"]), (["p", 1], None)]
    assert not again.add(0)
    again.close()


def test_a_torn_last_line_is_cut_and_the_next_id_is_not_glued_to_it(tmp_path: Path) -> None:
    """A process killed mid-write leaves part of a line that ``add`` never acknowledged."""
    path = os.path.join(tmp_path, "seen.jsonl")
    with open(path, "wb") as f:
        f.write(b'1\n{"id":2,"value":["x"]}\n{"id":3,"val')
    ledger = Ledger(path)
    assert set(ledger) == {1, 2}
    assert lines(path) == [b"1\n", b'{"id":2,"value":["x"]}\n']
    assert ledger.add(4)
    ledger.close()
    again = Ledger(path)
    assert set(again) == {1, 2, 4}
    assert list(again.items()) == [(1, None), (2, ["x"]), (4, None)]
    again.close()


def test_what_cannot_be_written_is_refused_and_not_recorded(tmp_path: Path) -> None:
    ledger = Ledger(os.path.join(tmp_path, "seen.jsonl"))
    with pytest.raises(TypeError) as err:
        ledger.add({"id": 1})
    assert str(err.value) == "a ledger id may not be a dict, got {'id': 1}; use str, int or lists"
    with pytest.raises(TypeError):
        ledger.add(1, {2, 3})  # a set is not JSON
    assert len(ledger) == 0 and list(ledger.items()) == []
    assert ledger.add(1, [2, 3])
    ledger.close()


def test_the_hello_counter_keeps_its_counts_across_a_restart(tmp_path: Path) -> None:
    """What it counted before a restart stays counted, and a line sent again is not counted
    twice: the ledger holds each line's words with its id."""

    async def main() -> None:
        first = Counter(RoleContext.local(name="counter", run_dir=str(tmp_path)))
        await first.setup()
        assert await first.add(Words(0, ["the", "fox"]))
        assert await first.add(Words(1, ["the", "dog"]))
        # Killed here: no teardown. The restarted replica is a new process with a new object.
        restarted = Counter(RoleContext.local(name="counter", run_dir=str(tmp_path)))
        await restarted.setup()
        assert not await restarted.add(Words(1, ["the", "dog"]))  # re-sent by the dispatcher
        assert await restarted.add(Words(2, ["a", "fox"]))
        assert await restarted.top(3) == [("fox", 2), ("the", 2), ("a", 1)]
        await restarted.teardown()
        first.seen.close()

    asyncio.run(main())

"""Split-mode reduction: merged moments equal one-shot ones; rounds follow their policy."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.clock import FakeClock
from asyncrl.roles.learning.statistics import Moments
from asyncrl.roles.sampling.reduce import Outcome, Reducer, Released, Straggler
from asyncrl.transport import run

DUE_S = 0.5  # a round's deadline on the fake clock (exact in binary, so sums are exact)
WAIT_S = 5.0

values = st.lists(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=200,
)


def _close(got: float, want: float, floor: float) -> bool:
    return abs(got - want) <= 1e-6 * abs(want) + floor


def _assert_matches_one_shot(m: Moments, data: list[float]) -> None:
    """Count exact; mean and variance within 1e-6 relative of the exact one-shot values.

    The floors allow for rounding in the merges: the mean is good to 1e-12 of the data's
    magnitude, and the standard deviation too (near-constant data of large magnitude has a
    variance far below the rounding of its values). Subnormal data is good to the smallest
    normal float.
    """
    scale = max(abs(x) for x in data) + sys.float_info.min
    mean = math.fsum(data) / len(data)
    var = statistics.pvariance(data)  # exact (rational arithmetic), rounded once
    assert m.count == len(data)
    assert _close(m.mean, mean, 1e-12 * scale), (m.mean, mean)
    floor = 1e-12 * scale
    assert _close(m.var, var, floor * math.sqrt(var) + floor * floor), (m.var, var)
    assert m.m2 >= 0.0


def _split(data: list[float], rnd: random.Random) -> list[list[float]]:
    """Cut ``data`` at random places into 1..len(data) non-empty runs."""
    cuts = sorted(rnd.sample(range(1, len(data)), rnd.randint(0, len(data) - 1)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# -- Moments ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(values, st.randoms(use_true_random=False))
def test_merging_in_any_order_and_tree_shape_equals_one_shot(
    data: list[float], rnd: random.Random
) -> None:
    assert Moments.of(data) == Moments.of(iter(data))  # any iterable
    _assert_matches_one_shot(Moments.of(data), data)
    parts = [Moments.of(p) for p in _split(data, rnd)]

    # Arrival order: one running merge, parts in a random order.
    order = parts[:]
    rnd.shuffle(order)
    acc = Moments(0, 0.0, 0.0)
    for p in order:
        acc = acc.merge(p)
    _assert_matches_one_shot(acc, data)

    # A random merge tree: two random nodes merged, in a random order, until one is left.
    nodes = parts[:]
    while len(nodes) > 1:
        a = nodes.pop(rnd.randrange(len(nodes)))
        b = nodes.pop(rnd.randrange(len(nodes)))
        nodes.append(a.merge(b) if rnd.random() < 0.5 else b.merge(a))
    _assert_matches_one_shot(nodes[0], data)

    # Through a reducer, parts added in a random order.
    released: list[Released] = []
    reducer = Reducer(released.append)
    for i in rnd.sample(range(len(parts)), len(parts)):
        assert reducer.add("g", f"p{i}", parts[i], expected=len(parts))
    (r,) = released
    assert (r.outcome, r.parts, r.expected) == (
        Outcome.COMPLETE,
        frozenset(f"p{i}" for i in range(len(parts))),
        len(parts),
    )
    _assert_matches_one_shot(r.moments, data)


def test_moments_of_known_values() -> None:
    m = Moments.of([1.0, 2.0, 3.0, 4.0])
    assert m == Moments(4, 2.5, 5.0)
    assert m.var == 1.25
    assert m.std == math.sqrt(1.25)
    assert Moments.of([]) == Moments(0, 0.0, 0.0)
    assert Moments(0, 0.0, 0.0).var == 0.0 and Moments(0, 0.0, 0.0).std == 0.0
    # Catastrophic cancellation in a naive sum of squares does not happen here.
    big = Moments.of([1e9 + 1, 1e9 + 2, 1e9 + 3])
    assert (big.mean, big.m2) == (1e9 + 2, 2.0)


def test_moments_of_one_value_equal_the_two_pass_ones() -> None:
    for x in (0.0, -0.0, 1.0, -3.5, 0.1, 1e300, 5e-324, math.inf, -math.inf, math.nan):
        one, of = Moments.one(x), Moments.of([x])
        assert one.count == of.count == 1
        # nan != nan: compare the fields' representations.
        assert (repr(one.mean), repr(one.m2)) == (repr(of.mean), repr(of.m2)), x


def test_merge_with_an_empty_side_returns_the_other() -> None:
    empty = Moments(0, 0.0, 0.0)
    m = Moments.of([5.0, 7.0])
    assert m.merge(empty) is m
    assert empty.merge(m) is m
    assert Moments.of([1.0, 2.0]).merge(Moments.of([3.0, 4.0])) == Moments(4, 2.5, 5.0)


def test_moments_travel_as_arrays() -> None:
    m = Moments(3, 1.5, 0.25)
    wire = msgspec.msgpack.encode(m)
    assert msgspec.msgpack.decode(wire) == [3, 1.5, 0.25]
    assert msgspec.msgpack.decode(wire, type=Moments) == m


# -- Reducer: rounds without deadlines ----------------------------------------------------


def _collect() -> tuple[list[Released], Callable[[Released], None]]:
    out: list[Released] = []
    return out, out.append


def test_a_round_completes_when_every_part_is_merged() -> None:
    clock = FakeClock(100.0)
    released, on_release = _collect()
    reducer = Reducer(on_release, clock=clock)
    reducer.open("g", 3)
    assert reducer.add("g", "a", Moments.of([1.0, 2.0]))
    clock.advance(1.5)
    assert reducer.add("g", "b", Moments.of([3.0]))
    assert released == [] and reducer.pending() == ["g"]
    assert reducer.add("g", "c", Moments.of([4.0]))
    (r,) = released
    assert (r.key, r.moments, r.parts, r.expected, r.outcome) == (
        "g",
        Moments(4, 2.5, 5.0),
        frozenset("abc"),
        3,
        Outcome.COMPLETE,
    )
    assert r.waited_s == 1.5
    assert reducer.pending() == []
    assert reducer.metrics == {
        "opened": 1,
        "complete": 1,
        "partial": 0,
        "dropped": 0,
        "overdue": 0,
        "duplicates": 0,
        "late": 0,
        "contributions": 3,
        "callback_errors": 0,
        "open_rounds": 0,
    }


def test_duplicates_are_merged_once_and_late_parts_are_refused() -> None:
    released, on_release = _collect()
    late: list[tuple[str, str]] = []
    reducer = Reducer(on_release, on_late=lambda k, p: late.append((k, p)))
    assert reducer.add("g", "a", Moments.of([1.0]), expected=2)
    assert not reducer.add("g", "a", Moments.of([1.0]), expected=2)
    assert not reducer.add("g", "a", Moments.of([100.0]))  # same id, whatever it carries
    assert released == []
    assert reducer.add("g", "b", Moments.of([3.0]))
    assert released[0].moments == Moments(2, 2.0, 2.0)
    assert not reducer.add("g", "c", Moments.of([5.0]), expected=2)
    assert not reducer.add("g", "a", Moments.of([1.0]))
    assert late == [("g", "c"), ("g", "a")]
    m = reducer.metrics
    assert (m["duplicates"], m["late"], m["contributions"], m["complete"]) == (2, 2, 2, 1)
    # Forgotten, the key is unknown again: it may open anew.
    reducer.forget("g")
    assert reducer.add("g", "a", Moments.of([9.0]), expected=1)
    assert [r.moments for r in released] == [Moments(2, 2.0, 2.0), Moments(1, 9.0, 0.0)]


def test_implicit_open_reopen_and_unknown_keys() -> None:
    released, on_release = _collect()
    reducer = Reducer(on_release)
    reducer.open("g", 2)
    reducer.open("g", 2)  # already open: nothing happens
    assert reducer.metrics["opened"] == 1
    with pytest.raises(KeyError) as err:
        reducer.add("h", "a", Moments.of([1.0]))
    assert err.value.args[0] == (
        "round 'h' is not open: open it with open('h', expected) first, or pass expected= to add()"
    )
    with pytest.raises(ValueError, match="round 'g' expects 2 parts, but part 'a' says 3"):
        reducer.add("g", "a", Moments.of([1.0]), expected=3)
    assert reducer.add("h", "a", Moments.of([1.0]), expected=1)  # opened by the part
    assert [r.key for r in released] == ["h"]
    with pytest.raises(ValueError) as reopen:
        reducer.open("h", 1)
    assert str(reopen.value) == (
        "round 'h' was already released; a key is used once (forget('h') to reuse it)"
    )
    with pytest.raises(ValueError, match=r"round 'x': expected must be at least 1, got 0"):
        reducer.open("x", 0)
    with pytest.raises(ValueError, match=r"round 'x': deadline_s must be a positive number"):
        reducer.open("x", 1, deadline_s=0.0)
    assert reducer.pending() == ["g"]
    assert reducer.metrics["opened"] == 2
    reducer.close()
    with pytest.raises(RuntimeError, match="the reducer is closed"):
        reducer.add("g", "b", Moments.of([1.0]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k_min": 0}, "k_min must be at least 1, got 0"),
        ({"deadline_s": 0.0}, "deadline_s must be a positive number of seconds or None, got 0.0"),
        ({"deadline_s": -1.0}, "deadline_s must be a positive number of seconds or None, got -1.0"),
        (
            {"policy": Straggler.EMIT},
            "straggler policy 'emit' acts at a deadline; pass deadline_s=<seconds>, or use "
            "policy 'wait'",
        ),
        (
            {"policy": Straggler.DROP},
            "straggler policy 'drop' acts at a deadline; pass deadline_s=<seconds>, or use "
            "policy 'wait'",
        ),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        Reducer(lambda r: None, **kwargs)
    assert str(err.value) == message


def test_a_failing_callback_leaves_the_reducer_consistent() -> None:
    def explode(r: Released) -> None:
        raise RuntimeError(f"consumer broke on {r.key}")

    reducer = Reducer(explode)
    assert reducer.add("g", "a", Moments.of([1.0]), expected=1)
    assert reducer.metrics["callback_errors"] == 1
    assert reducer.pending() == []
    assert not reducer.add("g", "a", Moments.of([1.0]))  # released, so late
    assert reducer.metrics["late"] == 1 and reducer.metrics["complete"] == 1


def test_a_failing_callback_goes_to_on_error_when_there_is_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An owner that raises callback errors where they can be handled gets each one; nothing
    is logged, and the count is kept all the same."""

    def explode(r: Released) -> None:
        raise TypeError(f"consumer broke on {r.key}")

    def late(key: str, part: str) -> None:
        raise ValueError(f"late part {part} of {key}")

    errors: list[Exception] = []
    reducer = Reducer(explode, on_late=late, on_error=errors.append)
    assert reducer.add("g", "a", Moments.of([1.0]), expected=1)
    assert not reducer.add("g", "b", Moments.of([1.0]))
    assert [(type(e), str(e)) for e in errors] == [
        (TypeError, "consumer broke on g"),
        (ValueError, "late part b of g"),
    ]
    assert reducer.metrics["callback_errors"] == 2
    assert caplog.records == []


# -- Reducer: deadlines, on a fake clock ---------------------------------------------------


class _Releases:
    """Collects released rounds; ``next()`` waits for the next one."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Released] = asyncio.Queue()
        self.late: list[tuple[str, str]] = []

    def __call__(self, r: Released) -> None:
        self.queue.put_nowait(r)

    def on_late(self, key: str, part: str) -> None:
        self.late.append((key, part))

    async def next(self) -> Released:
        return await asyncio.wait_for(self.queue.get(), WAIT_S)


def test_emit_releases_partial_at_the_deadline_with_k_min_parts() -> None:
    clock = FakeClock()
    released, on_release = _collect()
    late: list[tuple[str, str]] = []
    reducer = Reducer(
        on_release,
        policy=Straggler.EMIT,
        deadline_s=DUE_S,
        k_min=2,
        on_late=lambda k, p: late.append((k, p)),
        clock=clock,
    )
    reducer.open("g", 4)
    reducer.add("g", "a", Moments.of([1.0]))
    reducer.add("g", "b", Moments.of([3.0]))
    clock.advance(DUE_S - 0.125)
    assert released == []
    clock.advance(0.125)
    (r,) = released
    assert (r.key, r.outcome, r.parts, r.moments, r.waited_s) == (
        "g",
        Outcome.PARTIAL,
        frozenset("ab"),
        Moments(2, 2.0, 2.0),
        DUE_S,
    )
    assert not reducer.add("g", "c", Moments.of([5.0]))
    assert late == [("g", "c")]
    m = reducer.metrics
    assert (m["partial"], m["overdue"], m["late"], m["open_rounds"]) == (1, 0, 1, 0)


def test_emit_short_of_k_min_waits_for_the_k_min_th_part() -> None:
    clock = FakeClock()
    released, on_release = _collect()
    reducer = Reducer(on_release, policy=Straggler.EMIT, deadline_s=DUE_S, k_min=2, clock=clock)
    reducer.open("slow", 3)
    reducer.open("fast", 2, deadline_s=60.0)
    reducer.add("slow", "a", Moments.of([1.0]))
    clock.advance(2 * DUE_S)
    assert reducer.metrics["overdue"] == 1 and released == []
    assert reducer.pending() == ["slow", "fast"]  # 'fast' has a later deadline of its own
    assert reducer.add("slow", "b", Moments.of([2.0]))
    (r,) = released
    assert (r.key, r.outcome, r.parts, r.moments.count, r.waited_s) == (
        "slow",
        Outcome.PARTIAL,
        frozenset("ab"),
        2,
        2 * DUE_S,
    )
    reducer.add("fast", "a", Moments.of([1.0]))
    reducer.add("fast", "b", Moments.of([1.0]))
    assert [r.outcome for r in released] == [Outcome.PARTIAL, Outcome.COMPLETE]
    assert reducer.metrics["partial"] == 1 and reducer.metrics["complete"] == 1
    reducer.close()


def test_emit_prefers_complete_when_every_part_arrives_in_time() -> None:
    clock = FakeClock()
    released, on_release = _collect()
    reducer = Reducer(on_release, policy=Straggler.EMIT, deadline_s=DUE_S, k_min=1, clock=clock)
    reducer.add("g", "a", Moments.of([1.0]), expected=2)  # opened with the default deadline
    reducer.add("g", "b", Moments.of([2.0]))
    assert [r.outcome for r in released] == [Outcome.COMPLETE]
    assert clock.timers == 0  # its deadline was cancelled
    clock.advance(2 * DUE_S)
    assert len(released) == 1
    assert reducer.metrics["partial"] == 0 and reducer.metrics["overdue"] == 0


def test_drop_releases_dropped_at_the_deadline() -> None:
    clock = FakeClock()
    released, on_release = _collect()
    late: list[tuple[str, str]] = []
    reducer = Reducer(
        on_release,
        policy=Straggler.DROP,
        deadline_s=DUE_S,
        on_late=lambda k, p: late.append((k, p)),
        clock=clock,
    )
    reducer.add("g", "a", Moments.of([1.0]), expected=3)
    clock.advance(DUE_S)
    (r,) = released
    assert (r.key, r.outcome, r.parts, r.moments, r.expected, r.waited_s) == (
        "g",
        Outcome.DROPPED,
        frozenset("a"),
        Moments(1, 1.0, 0.0),
        3,
        DUE_S,
    )
    assert not reducer.add("g", "b", Moments.of([1.0]))
    assert late == [("g", "b")]
    assert reducer.metrics["dropped"] == 1


def test_wait_keeps_waiting_past_the_deadline_then_completes() -> None:
    clock = FakeClock()
    released, on_release = _collect()
    reducer = Reducer(on_release, policy=Straggler.WAIT, deadline_s=DUE_S, clock=clock)
    reducer.open("g", 2)
    reducer.open("h", 2, deadline_s=DUE_S / 2)
    reducer.add("g", "a", Moments.of([1.0]))
    clock.advance(DUE_S / 2)
    assert reducer.metrics["overdue"] == 1  # h's deadline came first
    clock.advance(DUE_S / 2)
    assert reducer.pending() == ["g", "h"]
    assert reducer.metrics["overdue"] == 2  # once per round
    clock.advance(DUE_S)
    assert reducer.metrics["overdue"] == 2 and released == []
    reducer.add("g", "b", Moments.of([3.0]))
    (r,) = released
    assert (r.outcome, r.moments, r.waited_s) == (Outcome.COMPLETE, Moments(2, 2.0, 2.0), 2 * DUE_S)
    assert reducer.pending() == ["h"]


def test_close_cancels_the_deadlines() -> None:
    clock = FakeClock()
    released, on_release = _collect()
    reducer = Reducer(on_release, policy=Straggler.DROP, deadline_s=DUE_S, clock=clock)
    reducer.open("g", 2)
    reducer.close()
    assert clock.timers == 0
    clock.advance(2 * DUE_S)
    assert released == []
    assert reducer.pending() == ["g"] and reducer.metrics["dropped"] == 0


def test_deadlines_run_on_the_event_loop_by_default() -> None:
    """The default clock is the real one: a deadline is a timer of the running loop. uvloop
    keeps timers to the millisecond of a time cached at each turn of the loop, so one may fire up
    to a millisecond before its delay has passed on the monotonic clock."""

    async def main() -> None:
        got = _Releases()
        reducer = Reducer(got, policy=Straggler.DROP, deadline_s=0.02)
        reducer.open("g", 2)
        r = await got.next()
        assert r.outcome == Outcome.DROPPED and r.waited_s >= 0.019

    run(main())

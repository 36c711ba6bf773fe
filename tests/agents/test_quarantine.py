"""Quarantine of environment replicas (asyncrl.roles.agents.quarantine), with a fake clock: a
replica failing more than its share of a window of steps takes no new episode but a probe, a
probe it serves lets it back, a probe it fails quarantines it again with the wait doubled, and
when every replica is out the error names them."""

from __future__ import annotations

import pytest

from asyncrl.clock import FakeClock
from asyncrl.roles.agents.quarantine import Quarantine, ReplicasQuarantinedError


def quarantine(clock: FakeClock, replicas: int = 3) -> Quarantine:
    return Quarantine("env", replicas, share=0.5, window=4, probe_after_s=30.0, clock=clock)


def test_a_replica_past_its_share_of_failed_steps_takes_no_new_episode() -> None:
    q = quarantine(FakeClock())
    for failed in (True, False, True):
        q.record(1, failed)
    assert q.pick() is None  # 3 steps judged of a window of 4: none quarantined yet
    q.record(1, False)
    assert not q.is_quarantined(1) and q.pick() is None  # 2 of 4 is not more than half
    q.record(1, True)  # the window: F, T, F, T
    assert not q.is_quarantined(1)
    assert q.record(1, True) == "quarantined: it failed 3 of its last 4 steps"  # T, F, T, T
    assert q.is_quarantined(1) and q.quarantined == 1
    assert {q.pick() for _ in range(10)} == {0, 2}  # the others carry the run


def test_a_quarantined_replica_gets_a_probe_and_is_let_back_when_it_serves_it() -> None:
    clock = FakeClock()
    q = quarantine(clock)
    for _ in range(4):
        q.record(2, True)
    assert q.is_quarantined(2)
    clock.advance(29.0)
    assert 2 not in {q.pick() for _ in range(10)}
    clock.advance(1.0)
    assert q.pick() == 2  # the probe
    assert 2 not in {q.pick() for _ in range(10)}  # one probe a period
    assert q.record(2, True) == "quarantined: it failed its probe"  # out again
    assert q.is_quarantined(2) and q.quarantined == 2
    clock.advance(30.0)
    assert 2 not in {q.pick() for _ in range(10)}  # the second wait is twice the first
    clock.advance(30.0)
    assert q.pick() == 2
    q.record(2, False)  # it served the probe
    assert not q.is_quarantined(2) and q.released == 1
    assert q.pick() is None
    for failed in (True, True, True):  # judged afresh: a new window
        q.record(2, failed)
    assert not q.is_quarantined(2)


def test_an_episode_played_again_is_not_sent_to_the_replica_that_failed_it() -> None:
    clock = FakeClock()
    q = quarantine(clock)
    for _ in range(4):
        q.record(2, True)
    assert {q.pick(avoid=0) for _ in range(10)} == {1}  # of the healthy 0 and 1
    clock.advance(30.0)
    assert q.pick(avoid=2) == 1  # env.2 is due a probe, but not with the episode it failed
    assert q.pick() == 2  # the next new episode probes it
    alone = quarantine(clock, replicas=1)
    for _ in range(4):
        alone.record(0, True)
    clock.advance(30.0)
    assert alone.pick(avoid=0) == 0  # nothing else could take it: probed all the same


def test_when_every_replica_is_quarantined_the_error_names_them() -> None:
    q = quarantine(FakeClock(), replicas=2)
    for replica in (0, 1):
        for _ in range(4):
            q.record(replica, True)
    with pytest.raises(ReplicasQuarantinedError) as info:
        q.pick()
    assert str(info.value) == (
        "every replica of 'env' is quarantined: env.0 failed 4 of its last 4 steps; env.1 "
        "failed 4 of its last 4 steps. Nothing can run episodes: see the environment's log "
        "for why its steps fail, or raise quarantine_share"
    )


def test_quarantines_in_a_row_back_off_up_to_a_limit_and_a_served_window_forgives_them() -> None:
    clock = FakeClock()
    q = Quarantine("env", 2, share=0.5, window=2, probe_after_s=10.0, probe_max_s=35.0, clock=clock)
    q.record(0, True)
    assert q.record(0, True) == "quarantined: it failed 2 of its last 2 steps"
    waits = []
    for _ in range(4):  # each probe fails: 10, 20, 35 (not 40), 35 s before the next
        waits.append(q.backoff_s(0))
        clock.advance(q.backoff_s(0))
        assert q.pick() == 0
        assert q.record(0, True) == "quarantined: it failed its probe"
    assert waits == [10.0, 20.0, 35.0, 35.0] and q.streak(0) == 5 and q.quarantined == 5
    clock.advance(35.0)
    assert q.pick() == 0
    q.record(0, False)  # it served this probe: let back, still in its streak
    assert not q.is_quarantined(0) and q.streak(0) == 5
    q.record(0, False)
    q.record(0, False)  # a whole window served: the streak is forgiven
    assert q.streak(0) == 0
    q.record(0, True)
    q.record(0, True)
    assert q.backoff_s(0) == 10.0  # quarantined again, it waits the first wait


def test_a_failure_of_an_episode_it_held_from_before_is_no_failed_probe() -> None:
    clock = FakeClock()
    q = quarantine(clock)
    for _ in range(4):
        q.record(1, True)
    assert q.record(1, True) == ""  # no probe went to it yet: the failure was judged already
    assert q.quarantined == 1 and q.backoff_s(1) == 30.0


def test_bad_quarantine_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^quarantine_share: expected a number in \[0, 1\)"):
        Quarantine("env", 2, share=1.0)
    with pytest.raises(ValueError, match=r"^quarantine_window: expected an int >= 1, got 0$"):
        Quarantine("env", 2, window=0)
    with pytest.raises(
        ValueError, match=r"^probe_max_s: expected a number >= probe_after_s \(30\)"
    ):
        Quarantine("env", 2, probe_max_s=10.0)

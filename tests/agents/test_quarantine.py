"""Quarantine of environment replicas (asyncrl.roles.agents.quarantine), with a fake clock: a
replica failing more than its share of a window of steps takes no new episode but a probe, a
probe it serves lets it back, and when every replica is out the error names them."""

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
    q.record(1, True)  # T, F, T, T: 3 of 4
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
    q.record(2, True)  # the probe failed: still out
    assert q.is_quarantined(2)
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


def test_bad_quarantine_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^quarantine_share: expected a number in \[0, 1\)"):
        Quarantine("env", 2, share=1.0)
    with pytest.raises(ValueError, match=r"^quarantine_window: expected an int >= 1, got 0$"):
        Quarantine("env", 2, window=0)

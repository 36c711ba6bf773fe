"""The error hierarchy: where each error hangs, what its message says, and the fatal
``RoleDeadError`` a handle raises when the dispatcher closes under a call."""

from __future__ import annotations

import asyncio
import logging
import pickle
from typing import Any

import pytest

import asyncrl.weights
from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.handles import Context
from asyncrl.errors import (
    AsyncrlError,
    BrokenError,
    ClosedError,
    ConfigError,
    ConfigProblem,
    DeadlineExceededError,
    ManifestError,
    NothingPublishedError,
    PeerDeadError,
    RoleDeadError,
    TornReadError,
    TransportError,
    WeightsError,
    WeightsGoneError,
)
from asyncrl.manifest.spec import GroupInfo
from asyncrl.transport import Call, ChannelOptions, Server, run

WAIT_S = 10.0


@pytest.mark.parametrize("cls", [WeightsGoneError, TornReadError, NothingPublishedError])
def test_weight_store_errors_are_runtime_errors(cls: type[AsyncrlError]) -> None:
    assert cls.__mro__[1:] == (WeightsError, AsyncrlError, Exception, BaseException, object)
    assert cls.retryable
    assert getattr(asyncrl.weights, cls.__name__) is cls


@pytest.mark.parametrize("cls", [ManifestError, ConfigProblem])
def test_configuration_errors_share_a_fatal_base(cls: type[AsyncrlError]) -> None:
    assert issubclass(cls, ConfigError) and not cls.retryable


def test_role_dead_is_fatal_and_names_the_role() -> None:
    err = RoleDeadError("rollout", "failed 4 times within 60 s, past its budget", 2)
    assert str(err) == (
        "role rollout[2] is dead: failed 4 times within 60 s, past its budget; nothing will "
        "answer it again in this run, so retrying cannot help. The run's report says why it "
        "ended."
    )
    assert (err.role, err.replica, err.reason) == (
        "rollout",
        2,
        "failed 4 times within 60 s, past its budget",
    )
    assert not err.retryable and not isinstance(err, TransportError)
    copy = pickle.loads(pickle.dumps(err))
    assert (type(copy), str(copy), copy.replica) == (RoleDeadError, str(err), 2)
    # The recoverable "dead" is another branch: a silent peer comes back under supervision.
    assert issubclass(PeerDeadError, BrokenError) and PeerDeadError.retryable


def test_deadline_names_pid_and_incarnation_only_when_known() -> None:
    known = DeadlineExceededError("ipc://x", "work", 0.25, pid=4242, incarnation=3)
    assert str(known) == (
        "request 'work' to ipc://x got no answer within its deadline of 0.250 s; the peer "
        "(pid 4242, incarnation 3) is slow, hung or gone. Raise the timeout if the work is "
        "legitimately long."
    )
    unknown = DeadlineExceededError("ipc://x", "work", 0.25)
    assert (unknown.pid, unknown.incarnation) == (None, None)
    assert str(unknown) == (
        "request 'work' to ipc://x got no answer within its deadline of 0.250 s; the peer is "
        "slow, hung or gone. Raise the timeout if the work is legitimately long."
    )


SHUTDOWN = (
    "role g is dead: the run is shutting down (the driver closed its connections with this call "
    "still queued or in flight); nothing will answer it again in this run, so retrying cannot "
    "help. The run's report says why it ended."
)


def _dispatcher(run_dir: str) -> tuple[Dispatcher, Context]:
    """A dispatcher for group ``g`` whose one replica is never up: calls stay queued."""
    info = GroupInfo([f"ipc://{run_dir}/nobody"], delivery={"work": "idempotent"})
    dispatcher = Dispatcher({"g": info}, run="t", startup_timeout_s=WAIT_S)
    dispatcher.start()
    return dispatcher, Context(dispatcher, run="t", run_dir=run_dir, log=logging.getLogger("t"))


def test_calls_queued_when_the_dispatcher_closes_fail_with_role_dead(run_dir: str) -> None:
    async def main() -> None:
        dispatcher, ctx = _dispatcher(run_dir)
        g = ctx.roles["g"]
        waits: list[asyncio.Task[Any]] = [
            asyncio.ensure_future(g.call("work", 1, timeout=3600)),
            asyncio.ensure_future(g.broadcast("work", 2, timeout=3600)),
            asyncio.ensure_future(anext(aiter(g.map("work", [3, 4], timeout=3600)))),
        ]
        await asyncio.sleep(0)  # one turn of the loop: each call is submitted, none can be sent
        assert dispatcher.groups["g"].stats["calls"] == 4
        await dispatcher.close()
        for task in waits:
            with pytest.raises(RoleDeadError) as err:
                await asyncio.wait_for(task, WAIT_S)
            assert str(err.value) == SHUTDOWN
            assert err.value.__cause__ is None

    run(main())


def test_a_caller_cancelling_its_own_call_still_gets_cancelled_error(run_dir: str) -> None:
    """Only the dispatcher's closing is a dead role; a caller's own cancellation stays one."""

    async def main() -> None:
        dispatcher, ctx = _dispatcher(run_dir)
        task = asyncio.ensure_future(ctx.roles["g"].call("work", 1, timeout=3600))
        await asyncio.sleep(0)  # submitted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await dispatcher.close()

    run(main())


def test_a_call_in_flight_when_the_dispatcher_closes_fails_with_role_dead(run_dir: str) -> None:
    """The dispatcher closes the client the call went through: the caller learns that the role
    is gone for good, with the client's ClosedError as the cause."""

    async def main() -> None:
        entered, gate = asyncio.Event(), asyncio.Event()

        async def work(payload: Any, call: Call) -> Any:
            entered.set()
            await gate.wait()
            return payload

        server = Server(f"ipc://{run_dir}/g0", options=ChannelOptions(run="t"))
        server.add("_describe", lambda payload, call: {"endpoints": {"work": "idempotent"}})
        server.add("work", work)
        await server.start()
        server.set_credit(1)
        info = GroupInfo([server.endpoint])
        dispatcher = Dispatcher({"g": info}, run="t", startup_timeout_s=WAIT_S)
        dispatcher.start()
        ctx = Context(dispatcher, run="t", run_dir=run_dir, log=logging.getLogger("t"))
        task = asyncio.ensure_future(ctx.roles["g"].call("work", 1, timeout=3600))
        await asyncio.wait_for(entered.wait(), WAIT_S)
        await dispatcher.close()
        with pytest.raises(RoleDeadError) as err:
            await asyncio.wait_for(task, WAIT_S)
        assert str(err.value) == SHUTDOWN
        assert isinstance(err.value.__cause__, ClosedError)
        gate.set()
        await server.close()

    run(main())

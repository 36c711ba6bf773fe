"""One-way streams: order, back-pressure without loss, bad input dropped and counted."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np
import zmq

from asyncrl.transport import (
    PROTOCOL_VERSION,
    ChannelOptions,
    Codec,
    Envelope,
    Kind,
    StreamReceiver,
    StreamSender,
    run,
)
from asyncrl.transport.protocol import MAX_BATCH
from asyncrl.transport.stream_codec import BATCH_ITEMS, encode_batch


class Item(msgspec.Struct):
    n: int


def test_everything_arrives_in_order(run_dir: str) -> None:
    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/st", Item) as receiver:
            async with StreamSender(receiver.endpoint, topic="items") as sender:
                for n in range(5000):
                    await sender.send(Item(n))
                got: list[int] = []
                while len(got) < 5000:
                    got += [item.n for item in await receiver.recv_batch()]
            assert got == list(range(5000))
            assert receiver.stats["received"] == 5000

    run(main())


def test_a_full_receiver_makes_the_sender_wait_and_loses_nothing(run_dir: str) -> None:
    options = ChannelOptions(send_hwm=4, recv_hwm=4)
    total = 100_000  # far more than the queues and socket buffers between the two can hold

    async def main() -> None:
        async with StreamReceiver(
            f"ipc://{run_dir}/bp", Item, capacity=8, options=options
        ) as receiver:
            async with StreamSender(receiver.endpoint, options=options) as sender:
                sent = 0

                async def produce() -> None:
                    nonlocal sent
                    for n in range(total):
                        await sender.send(Item(n))
                        sent = n + 1

                producer = asyncio.ensure_future(produce())
                # Nobody reads: the receiver fills to capacity and stops reading ...
                while not receiver._pump or not receiver._pump.paused:  # noqa: ASYNC110
                    await asyncio.sleep(0)  # no event exists for "paused"; one loop turn each
                # ... and the producer ends up waiting, with most items not sent.
                for _ in range(50):
                    await asyncio.sleep(0.002)
                assert not producer.done()
                assert len(receiver) == 8
                assert sent < total // 2
                got: list[int] = []
                while len(got) < total:
                    got += [item.n for item in await receiver.recv_batch()]
                await producer
            assert got == list(range(total))

    run(main())


def test_bad_messages_are_dropped_and_counted(run_dir: str) -> None:
    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/bad", Item) as receiver:
            raw = zmq.Context.instance().socket(zmq.PUSH)
            raw.connect(receiver.endpoint)
            raw.send(b"\xc1 not msgpack")
            raw.send(msgspec.msgpack.encode([1, 11, 1, "", 0.0, 0, 0, "", {"n": "str"}]))
            raw.send(msgspec.msgpack.encode([1, 3, 1, "", 0.0, 0, 0, "", {"n": 1}]))
            raw.send(msgspec.msgpack.encode([1, 11, 2, "", 0.0, 0, 0, "", {"n": 42}]))
            assert (await receiver.recv()).n == 42
            raw.close(linger=0)
            assert receiver.stats["bad_input"] == 3

    run(main())


def test_encode_message_writes_the_same_bytes_as_an_envelope() -> None:
    payload = {"n": 3, "x": np.arange(4, dtype=np.int32), "t": np.zeros(2048, dtype=np.uint8)}
    env = Envelope(PROTOCOL_VERSION, Kind.MESSAGE, 7, "topic", incarnation=2, payload=payload)
    expected = Codec().encode(env)
    frames = Codec().encode_message(7, "topic", 2, payload)
    assert frames[0] == expected[0]
    assert [bytes(f) for f in frames[1:]] == [bytes(f) for f in expected[1:]] != []


def test_messages_the_fast_path_does_not_take_still_arrive(run_dir: str) -> None:
    """Tensors (inline and as frames) and envelopes shorter than asyncrl writes them are decoded
    by the full codec, in order with the rest of their sender's messages."""

    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/mixed") as receiver:
            async with StreamSender(receiver.endpoint) as sender:
                await sender.send({"n": 0})
                await sender.send({"n": 1, "a": np.arange(3.0)})
                await sender.send({"n": 2, "a": np.ones(4096)})
                raw = zmq.Context.instance().socket(zmq.PUSH)
                raw.connect(receiver.endpoint)
                raw.send(msgspec.msgpack.encode([1, 11, 9]))
                raw.close(linger=1000)
                got: list[Any] = []
                while len(got) < 4:
                    got += await receiver.recv_batch()
            assert got.count(None) == 1  # the short envelope: its payload defaults to nil
            mine = [item for item in got if item is not None]
            assert [item["n"] for item in mine] == [0, 1, 2]
            assert mine[1]["a"].tolist() == [0.0, 1.0, 2.0]
            assert mine[2]["a"].shape == (4096,) and float(mine[2]["a"].sum()) == 4096.0
            assert receiver.stats == {"received": 4}

    run(main())


def _message(n: Any) -> bytes:
    return msgspec.msgpack.encode([1, 11, 1, "", 0.0, 0, 0, "", {"n": n}, []])


def test_messages_of_one_turn_travel_as_one_batch_in_order(run_dir: str) -> None:
    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/batch", Item) as receiver:
            raw = zmq.Context.instance().socket(zmq.PULL)
            raw.bind(f"ipc://{run_dir}/tap")
            async with StreamSender(f"ipc://{run_dir}/tap", topic="t") as sender:
                for n in range(BATCH_ITEMS + 3):
                    assert sender.send_nowait(Item(n))
                await sender.drained()
                frames = [raw.recv_multipart(), raw.recv_multipart()]
            raw.close(linger=0)
            envelopes = [msgspec.msgpack.decode(f[0]) for [*f] in frames]
            assert [env[:4] for env in envelopes] == [[1, 12, 0, "t"], [1, 12, 0, "t"]]
            items = envelopes[0][8] + envelopes[1][8]
            assert [env[1:3] for env in items] == [[11, n + 1] for n in range(BATCH_ITEMS + 3)]
            assert [env[8]["n"] for env in items] == list(range(BATCH_ITEMS + 3))
            # The receiver takes the same frames.
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.connect(receiver.endpoint)
            for f in frames:
                push.send_multipart(f)
            got: list[int] = []
            while len(got) < BATCH_ITEMS + 3:
                got += [item.n for item in await receiver.recv_batch()]
            push.close(linger=0)
            assert got == list(range(BATCH_ITEMS + 3))

    run(main())


def test_a_bad_envelope_inside_a_batch_is_dropped_and_the_rest_delivered(run_dir: str) -> None:
    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/badbatch", Item) as receiver:
            raw = zmq.Context.instance().socket(zmq.PUSH)
            raw.connect(receiver.endpoint)
            items = [_message(0), _message("str"), b"\xc0", _message(3)]
            items.append(msgspec.msgpack.encode([1, 12, 0, "", 0.0, 0, 0, "", [], []]))
            items.append(_message(5))
            raw.send(encode_batch("", 0, items))
            too_many = encode_batch("", 0, [_message(9)] * (MAX_BATCH + 1))
            raw.send(too_many)
            raw.send(encode_batch("", 0, [_message(6), _message(7)]))
            got: list[int] = []
            while len(got) < 5:
                got += [item.n for item in await receiver.recv_batch()]
            raw.close(linger=0)
            assert got == [0, 3, 5, 6, 7]
            # the str payload, the nil, the nested BATCH, and the batch over MAX_BATCH
            assert receiver.stats == {"received": 5, "bad_input": 4}

    run(main())


def test_a_batch_past_capacity_is_held_and_reading_stops(run_dir: str) -> None:
    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/held", Item, capacity=3) as receiver:
            raw = zmq.Context.instance().socket(zmq.PUSH)
            raw.connect(receiver.endpoint)
            raw.send(encode_batch("", 0, [_message(n) for n in range(5)]))
            raw.send(_message(5))
            assert (await receiver.recv()).n == 0
            assert receiver._pump is not None
            while len(receiver) < 3:  # noqa: ASYNC110
                await asyncio.sleep(0)  # the second of the held moves up when one is taken
            assert len(receiver) == 3 and receiver._pump.paused
            got = [0]
            while len(got) < 6:
                got += [item.n for item in await receiver.recv_batch(2)]
                assert len(receiver) <= 3
            raw.close(linger=0)
            assert got == [0, 1, 2, 3, 4, 5]

    run(main())


def test_what_was_sent_before_close_still_goes(run_dir: str) -> None:
    """A sender closed in the loop turn of its last sends hands them to the socket first."""

    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/st", Item) as receiver:
            async with StreamSender(receiver.endpoint) as sender:
                for n in range(3):
                    await sender.send(Item(n))
            got: list[int] = []
            while len(got) < 3:
                got += [item.n for item in await asyncio.wait_for(receiver.recv_batch(), 10)]
            assert got == [0, 1, 2]

    run(main())


def test_a_batch_stays_under_the_receivers_message_limit(run_dir: str) -> None:
    """With max_message_bytes of 50,000, sixty messages of about 1 KB sent in one turn travel in
    batches the receiver accepts (one batch of all of them would be refused, and lost)."""
    options = ChannelOptions(max_message_bytes=50_000)

    async def main() -> None:
        async with StreamReceiver(f"ipc://{run_dir}/st", Any, options=options) as receiver:
            async with StreamSender(receiver.endpoint, options=options) as sender:
                for n in range(60):
                    sender.send_nowait({"n": n, "pad": "x" * 1000})
                await sender.drained()
                got: list[int] = []
                while len(got) < 60:
                    got += [m["n"] for m in await asyncio.wait_for(receiver.recv_batch(), 10)]
            assert got == list(range(60))

    run(main())

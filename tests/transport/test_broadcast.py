"""Broadcast: the latest value per topic wins; topics sharing a prefix stay apart."""

from __future__ import annotations

import msgspec

from asyncrl.transport import Publisher, Subscriber, run


class Version(msgspec.Struct):
    v: int


def test_latest_value_wins(run_dir: str) -> None:
    async def main() -> None:
        async with Publisher(f"ipc://{run_dir}/pub") as pub:
            async with Subscriber(pub.endpoint, {"weights": Version, "w": Version}) as sub:
                # A subscriber joins asynchronously; publish until it has heard something.
                n = 0
                while sub.latest("weights") is None:
                    n += 1
                    pub.publish("weights", Version(n))
                    pub.publish("weightsX", Version(-1))
                    await _turn()
                for v in range(n + 1, n + 100):
                    pub.publish("weights", Version(v))
                last = await sub.wait_for("weights", lambda x: x.v == n + 99)
                assert last == Version(n + 99)
                assert sub.latest("w") is None  # "weights" must not land on "w"
                pub.publish("w", Version(7))
                assert await sub.wait_for("w") == Version(7)
                assert sub.latest("weights") == Version(n + 99)

    run(main())


async def _turn() -> None:
    import asyncio

    await asyncio.sleep(0.001)

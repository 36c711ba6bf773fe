"""Weight sync through shared memory: round trips, versions, no torn reads, the segment's life.

The in-process tests keep their segment in a private directory standing in for /dev/shm. The torn
read tests make the writer and the readers race for real (threads, and a reader process); the
negative control pauses the writer in the middle of a publish and shows that a reader without the
seqlock's re-check does copy a torn snapshot there, so the race tests could fail.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.errors import ClosedError, TransportError, WeightsError
from asyncrl.transport.shm import segment_name, sweep
from asyncrl.weights import (
    NO_VERSION,
    NothingPublishedError,
    TornReadError,
    WeightReader,
    WeightsGoneError,
    WeightsHandle,
    WeightStore,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_S = 30.0  # how long a test waits on an event before it fails; never slept


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    return str(tmp_path)


def _template() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.zeros(3, 4, dtype=torch.float32),
        "norm.weight": torch.zeros(5, dtype=torch.bfloat16),
        "positions": torch.zeros(2, 3, 1, dtype=torch.int64),
        "mask": torch.zeros(7, dtype=torch.bool),
        "scale": torch.zeros((), dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
    }


def _random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(3, 4, generator=g),
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "positions": torch.randint(-(2**40), 2**40, (2, 3, 1), generator=g),
        "mask": torch.rand(7, generator=g) > 0.5,
        "scale": torch.randn((), generator=g, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }


@pytest.fixture
def store(shm_dir: str) -> Iterator[WeightStore]:
    store = WeightStore(_template(), run="unit", directory=shm_dir)
    yield store
    store.close()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


# -- round trips and versions ---------------------------------------------------------------------


def test_round_trip_of_every_dtype_and_shape(store: WeightStore, shm_dir: str) -> None:
    reader = WeightReader(store.describe(), directory=shm_dir)
    first, second = _random_state(1), _random_state(2)
    store.publish(first, 1)
    version, got = reader.read()
    assert version == 1
    _assert_same(got, first)

    store.publish(second, 2)
    version, got = reader.read()
    assert version == 2
    _assert_same(got, second)
    # The slot of version 1 is reused for version 3: nothing of version 1 is left in it.
    store.publish(first, 3)
    assert reader.read()[0] == 3
    _assert_same(reader.read()[1], first)
    reader.close()


def test_non_contiguous_and_grad_tensors_publish_their_values(
    store: WeightStore, shm_dir: str
) -> None:
    state = _random_state(3)
    state["embed.weight"] = torch.randn(4, 3).t().requires_grad_(True)  # a transposed parameter
    assert not state["embed.weight"].is_contiguous()
    store.publish(state, 0)
    with WeightReader(store.describe(), directory=shm_dir) as reader:
        _assert_same(reader.read()[1], {k: v.detach() for k, v in state.items()})


def test_versions_increase_and_read_if_newer(store: WeightStore, shm_dir: str) -> None:
    reader = WeightReader(store.describe(), directory=shm_dir)
    assert reader.version() == NO_VERSION == store.version == -1
    assert reader.read_if_newer(NO_VERSION) is None
    with pytest.raises(NothingPublishedError) as info:
        reader.read()
    assert str(info.value) == (
        f"nothing published yet in weights {store.name}; wait for the learner's first publish, "
        f"or use read_if_newer(NO_VERSION)"
    )
    assert info.value.retryable

    state = _random_state(4)
    store.publish(state, 5)
    assert reader.version() == store.version == 5
    got = reader.read_if_newer(NO_VERSION)
    assert got is not None and got[0] == 5
    _assert_same(got[1], state)
    newer = reader.read_if_newer(4)
    assert newer is not None and newer[0] == 5
    assert reader.read_if_newer(5) is None
    assert reader.read_if_newer(6) is None

    for stale in (5, 4, -3):
        with pytest.raises(ValueError) as error:
            store.publish(state, stale)
        assert str(error.value) == (
            f"version {stale} does not increase: {store.name} already holds version 5; "
            f"versions are >= 0 and grow with every publish"
        )
    store.publish(state, 7)
    assert reader.version() == 7
    assert reader.retries == 0


def test_read_into_reuses_the_callers_tensors(store: WeightStore, shm_dir: str) -> None:
    reader = WeightReader(store.describe(), directory=shm_dir)
    into = {name: torch.full_like(t, 1) for name, t in _template().items()}
    pointers = {name: t.data_ptr() for name, t in into.items()}
    for version in (1, 2):
        state = _random_state(10 + version)
        store.publish(state, version)
        got_version, got = reader.read(into)
        assert got_version == version and got is into
        assert {name: t.data_ptr() for name, t in got.items()} == pointers
        _assert_same(got, state)


def test_mismatched_tensors_are_all_listed(store: WeightStore, shm_dir: str) -> None:
    state = _random_state(5)
    del state["mask"]
    state["embed.weight"] = torch.zeros(4, 3)
    state["positions"] = torch.zeros(2, 3, 1, dtype=torch.int32)
    state["extra"] = torch.zeros(1)
    with pytest.raises(ValueError) as info:
        store.publish(state, 1)
    assert str(info.value) == (
        "state_dict does not match the store's tensor table:\n"
        "  state_dict lacks ['mask']\n"
        "  state_dict has unknown tensors ['extra']\n"
        "  state_dict['embed.weight']: shape (4, 3), expected (3, 4)\n"
        "  state_dict['positions']: dtype int32, expected int64"
    )
    assert store.version == NO_VERSION  # nothing was written

    store.publish(_random_state(6), 1)
    reader = WeightReader(store.describe(), directory=shm_dir)
    into = {name: torch.zeros_like(t) for name, t in _template().items()}
    into["embed.weight"] = torch.zeros(4, 3).t()
    with pytest.raises(ValueError) as info:
        reader.read(into)
    assert str(info.value) == (
        "into does not match the store's tensor table:\n  into['embed.weight']: not contiguous"
    )


def test_the_handle_travels_and_describes_the_layout(store: WeightStore, shm_dir: str) -> None:
    handle = store.describe()
    wire = msgspec.msgpack.encode(handle)
    received = msgspec.msgpack.decode(wire, type=WeightsHandle)
    assert received == handle

    seq = int(handle.segment.rsplit(".", 1)[1])
    assert handle.segment == store.name == segment_name("unit", os.getpid(), 0, seq)
    assert [t.name for t in handle.tensors] == list(_template())
    assert [(t.dtype, t.shape, t.nbytes) for t in handle.tensors] == [
        ("float32", (3, 4), 48),
        ("bfloat16", (5,), 10),
        ("int64", (2, 3, 1), 48),
        ("bool", (7,), 7),
        ("float64", (), 8),
        ("float32", (0, 4), 0),
    ]
    assert [t.offset for t in handle.tensors] == [0, 64, 128, 192, 256, 320]
    assert handle.slot_bytes == 4096
    assert handle.slot_offsets == (4096, 8192)
    assert os.path.getsize(os.path.join(shm_dir, store.name)) == 3 * 4096

    store.publish(_random_state(7), 9)
    with WeightReader(received, directory=shm_dir) as reader:
        assert reader.read()[0] == 9


def test_the_header_is_where_the_module_docstring_says(store: WeightStore, shm_dir: str) -> None:
    state = _random_state(8)
    store.publish(state, 41)
    store.publish(state, 42)
    raw = Path(shm_dir, store.name).read_bytes()
    words = struct.unpack_from("=8q", raw, 0)
    assert raw[:8] == b"arlweigh"
    assert words[1:] == (1, 4096, 4096, 0, 1, 42, os.getpid())
    assert struct.unpack_from("=2q", raw, 64) == (2, 41)  # slot 0: written once, version 41
    assert struct.unpack_from("=2q", raw, 128) == (2, 42)  # slot 1: written once, version 42
    assert store.describe().tensors[0].offset == 0
    slot1 = np.frombuffer(raw, dtype=np.float32, count=12, offset=8192)  # embed.weight, v42
    assert torch.equal(torch.from_numpy(slot1.copy()).view(3, 4), state["embed.weight"])


# -- no torn reads --------------------------------------------------------------------------------


def _racing_template() -> dict[str, torch.Tensor]:
    """Big enough that a copy takes a while and runs without the GIL."""
    return {
        "a": torch.zeros(1 << 18, dtype=torch.float32),
        "b": torch.zeros(256, 128, dtype=torch.int64),
        "c": torch.zeros(1 << 14, dtype=torch.float64),
        "d": torch.zeros(999, dtype=torch.int32),
    }


def _torn(version: int, state: dict[str, torch.Tensor]) -> str:
    """'' when every element of every tensor equals ``version``, else what differs."""
    wrong = []
    for name, t in state.items():
        values = t.numpy()  # numpy, not torch: torch's intra-op threads crawl on a busy machine
        if not (values == version).all():
            wrong.append(f"{name} holds {sorted({int(v) for v in np.unique(values)})[:4]}")
    return f"version {version}: {', '.join(wrong)}" if wrong else ""


def _publish_all(store: WeightStore, versions: range) -> None:
    state = _racing_template()
    for version in versions:
        for t in state.values():
            t.numpy().fill(version)
        store.publish(state, version)


def _read_until(reader: WeightReader, last: int) -> tuple[list[str], set[int], int]:
    """Read continuously until ``last`` is seen: (torn snapshots, versions seen, reads)."""
    torn: list[str] = []
    seen: set[int] = set()
    reads = 0
    into = {name: torch.empty_like(t) for name, t in _racing_template().items()}
    version = NO_VERSION
    while version != last:
        try:
            version, state = reader.read(into)
        except NothingPublishedError:
            continue
        reads += 1
        seen.add(version)
        problem = _torn(version, state)
        if problem:
            torn.append(problem)
    return torn, seen, reads


def test_no_torn_reads_between_threads(shm_dir: str) -> None:
    last = 400
    store = WeightStore(_racing_template(), run="race", directory=shm_dir)
    readers = [
        WeightReader(store.describe(), directory=shm_dir, max_retries=100_000) for _ in range(3)
    ]
    try:
        with ThreadPoolExecutor(len(readers) + 1) as pool:
            reading = [pool.submit(_read_until, reader, last) for reader in readers]
            writing = pool.submit(_publish_all, store, range(1, last + 1))
            writing.result(timeout=WAIT_S)
            results = [future.result(timeout=WAIT_S) for future in reading]
    finally:
        store.close()
    for torn, seen, reads in results:
        assert torn == []
        assert last in seen and reads >= len(seen) >= 1
    assert len(set().union(*(seen for _, seen, _ in results))) > 1  # they did read mid-race


class _PausingStore(WeightStore):
    """Stops after the first tensor of the publish of ``pause_at`` until ``resume`` is set."""

    pause_at = NO_VERSION

    def __init__(self, template: dict[str, torch.Tensor], directory: str) -> None:
        super().__init__(template, run="pause", directory=directory)
        self.paused = threading.Event()
        self.resume = threading.Event()
        self._publishing = NO_VERSION

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._publishing = version
        super().publish(state_dict, version)

    def _after_tensor(self, slot: int, index: int) -> None:
        if index == 0 and self._publishing == self.pause_at:
            self.paused.set()
            if not self.resume.wait(WAIT_S):
                raise TimeoutError("the test never resumed the writer")


class _PausingReader(WeightReader):
    """Stops before its first copy, once it chose a slot, until ``go`` is set."""

    def __init__(self, handle: WeightsHandle, directory: str) -> None:
        super().__init__(handle, directory=directory)
        self.ready = threading.Event()
        self.go = threading.Event()

    def _before_copy(self, slot: int) -> None:
        if not self.ready.is_set():
            self.ready.set()
            if not self.go.wait(WAIT_S):
                raise TimeoutError("the test never let the reader copy")


class _UncheckedReader(_PausingReader):
    """Broken on purpose: trusts its copy without looking at the slot's sequence again."""

    def _unchanged(self, header: np.ndarray, slot: int, seq: int) -> bool:
        return True


def _filled(version: int) -> dict[str, torch.Tensor]:
    return {
        "a": torch.full((1000,), version, dtype=torch.float32),
        "b": torch.full((1000,), version, dtype=torch.int64),
    }


@pytest.mark.parametrize(
    ("reader_class", "expect_version", "expect_a", "expect_b", "expect_retries"),
    [
        (_PausingReader, 2, 2, 2, 1),  # noticed the writer and copied the newer slot instead
        (_UncheckedReader, 1, 3, 1, 0),  # the negative control: half version 3, half version 1
    ],
)
def test_a_reader_lapped_by_the_writer(
    shm_dir: str,
    reader_class: type[_PausingReader],
    expect_version: int,
    expect_a: int,
    expect_b: int,
    expect_retries: int,
) -> None:
    store = _PausingStore(_filled(0), shm_dir)
    reader = reader_class(store.describe(), shm_dir)
    try:
        store.publish(_filled(1), 1)  # slot 0
        with ThreadPoolExecutor(2) as pool:
            reading = pool.submit(reader.read)  # chooses slot 0 and waits before copying it
            assert reader.ready.wait(WAIT_S)
            store.publish(_filled(2), 2)  # slot 1: the reader is not disturbed yet
            store.pause_at = 3
            writing = pool.submit(store.publish, _filled(3), 3)  # slot 0 again: laps the reader
            assert store.paused.wait(WAIT_S)  # tensor a of slot 0 holds 3, tensor b still 1
            reader.go.set()
            version, state = reading.result(timeout=WAIT_S)  # copied while the writer waits
            store.resume.set()
            writing.result(timeout=WAIT_S)
        assert version == expect_version
        assert sorted(set(state["a"].tolist())) == [expect_a]
        assert sorted(set(state["b"].tolist())) == [expect_b]
        assert (_torn(version, state) == "") == (reader_class is _PausingReader)
        assert reader.retries == expect_retries
        version, state = reader.read()
        assert version == 3 and _torn(3, state) == ""
    finally:
        store.resume.set()
        reader.go.set()
        reader.close()
        store.close()


def test_a_reader_that_keeps_being_lapped_gives_up(shm_dir: str) -> None:
    """Every copy races with two publishes: the reader retries max_retries times, then raises."""

    store = WeightStore(_filled(0), run="lapped", directory=shm_dir)

    class Lapped(WeightReader):
        def _before_copy(self, slot: int) -> None:
            for _ in range(2):
                store.publish(_filled(store.version + 1), store.version + 1)

    try:
        store.publish(_filled(1), 1)
        reader = Lapped(store.describe(), directory=shm_dir, max_retries=3)
        with pytest.raises(TornReadError) as info:
            reader.read()
        assert str(info.value) == (
            f"no complete snapshot of weights {store.name} in 4 attempts: the writer "
            f"(pid {os.getpid()}) overwrote the slot being copied every time, publishing twice "
            f"during one copy; publish less often or raise max_retries"
        )
        assert info.value.retryable and reader.retries == 4 and store.version == 9
    finally:
        store.close()


def test_a_publish_that_fails_midway_leaves_readers_on_the_last_version(shm_dir: str) -> None:
    class Failing(WeightStore):
        fail = False

        def _after_tensor(self, slot: int, index: int) -> None:
            if self.fail and index == 0:
                raise RuntimeError("device lost")

    store = Failing(_filled(0), run="fail", directory=shm_dir)
    reader = WeightReader(store.describe(), directory=shm_dir)
    try:
        store.publish(_filled(1), 1)
        store.publish(_filled(2), 2)
        store.fail = True
        with pytest.raises(RuntimeError, match="device lost"):
            store.publish(_filled(3), 3)  # into slot 0: tensor a written, b not
        assert store.version == reader.version() == 2
        version, state = reader.read()
        assert version == 2 and _torn(2, state) == ""
        store.fail = False
        store.publish(_filled(4), 4)  # slot 0 again, its sequence still even when stable
        version, state = reader.read()
        assert version == 4 and _torn(4, state) == ""
        raw = Path(shm_dir, store.name).read_bytes()
        assert struct.unpack_from("=2q", raw, 64) == (6, 4)  # slot 0: three writes began
        assert reader.retries == 0
    finally:
        reader.close()
        store.close()


CHILD = "import sys; from tests.test_weights import _child_reader; sys.exit(_child_reader())"


def _child_reader() -> int:
    """In a reader process: argv is the handle as JSON, the directory and the last version."""
    handle = msgspec.json.decode(sys.argv[1], type=WeightsHandle)
    reader = WeightReader(handle, directory=sys.argv[2], max_retries=100_000)
    print("READY", flush=True)
    torn, seen, reads = _read_until(reader, int(sys.argv[3]))
    print(f"torn={len(torn)} versions={len(seen)} reads={reads} retries={reader.retries}")
    for problem in torn[:5]:
        print(problem)
    reader.close()
    return 1 if torn else 0


@pytest.mark.slow
def test_no_torn_reads_in_another_process(shm_dir: str) -> None:
    last = 1500
    store = WeightStore(_racing_template(), run="proc", directory=shm_dir)
    handle = msgspec.json.encode(store.describe()).decode()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, handle, shm_dir, str(last)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "READY\n"
        _publish_all(store, range(1, last + 1))
        out, _ = child.communicate(timeout=WAIT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        store.close()
    assert child.returncode == 0, out
    assert out.startswith("torn=0 versions="), out
    assert int(out.split()[1].removeprefix("versions=")) > 1, out  # it read mid-race


# -- the segment's life ---------------------------------------------------------------------------


def test_close_unlinks_and_mapped_readers_fail_clearly(shm_dir: str) -> None:
    store = WeightStore(_template(), run="life", directory=shm_dir)
    store.publish(_random_state(1), 1)
    handle = store.describe()
    reader = WeightReader(handle, directory=shm_dir)
    assert os.listdir(shm_dir) == [store.name]
    reader.close()
    reader.close()
    assert os.listdir(shm_dir) == [store.name]  # readers never unlink
    with pytest.raises(ClosedError) as closed:
        reader.read()
    assert str(closed.value) == (
        f"weight reader of {store.name} is closed; open a new WeightReader"
    )

    reader = WeightReader(handle, directory=shm_dir)
    store.close()
    store.close()
    assert os.listdir(shm_dir) == []
    gone = (
        f"weights {store.name} are gone: the learner (pid {os.getpid()}) closed its WeightStore; "
        f"get a fresh WeightsHandle from it and open a new WeightReader"
    )
    for call in (reader.read, reader.version, lambda: reader.read_if_newer(0)):
        with pytest.raises(WeightsGoneError) as info:
            call()
        assert str(info.value) == gone
        assert isinstance(info.value, WeightsError) and info.value.retryable
        assert not isinstance(info.value, TransportError)  # shared memory, not a channel
    reader.close()

    with pytest.raises(WeightsGoneError) as info:
        WeightReader(handle, directory=shm_dir)
    assert str(info.value) == (
        f"weights {store.name} are gone: the learner (pid {os.getpid()}) closed its WeightStore, "
        f"or died and it was swept; get a fresh WeightsHandle from it and open a new WeightReader"
    )
    assert isinstance(info.value.__cause__, FileNotFoundError)

    with pytest.raises(ClosedError) as closed:
        store.publish(_random_state(2), 2)
    assert str(closed.value) == (
        f"weight store {store.name} is closed; create a new WeightStore to publish"
    )


def test_a_dead_writers_segment_is_swept(store: WeightStore, shm_dir: str) -> None:
    """The supervisor sweeps the segments of a role it saw die; weights are among them."""
    assert sweep("unit", directory=shm_dir) == []  # our own, alive: kept
    assert sweep("unit", pid=os.getpid(), directory=shm_dir) == [store.name]
    with pytest.raises(WeightsGoneError):
        WeightReader(store.describe(), directory=shm_dir)


def test_a_handle_from_another_host_is_refused(store: WeightStore, shm_dir: str) -> None:
    handle = msgspec.structs.replace(store.describe(), host="elsewhere/boot/1:2")
    with pytest.raises(ValueError) as info:
        WeightReader(handle, directory=shm_dir)
    assert str(info.value).startswith(
        f"weights handle {store.name} comes from host 'elsewhere/boot/1:2', this is "
    )
    assert str(info.value).endswith(
        ": shared memory works on one host only; send the weights as frames"
    )


# -- a corrupt header ----------------------------------------------------------------------------

_HEADER_WORDS = list(range(18))  # every word the layout gives a meaning, and the reserved ones


@settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(
        st.tuples(
            st.sampled_from(_HEADER_WORDS),
            st.one_of(
                st.integers(-(2**63), 2**63 - 1),
                st.sampled_from([-1, 0, 1, 2, 3, 41, 2**31, 2**62]),
            ),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_corrupt_header_is_refused_clearly_never_crashes(
    store: WeightStore, shm_dir: str, words: list[tuple[int, int]]
) -> None:
    """Random values in the header of a published store: a reader either opens and reads a
    snapshot of the right shapes, or raises a typed error naming the segment; it never crashes,
    hangs, indexes out of range or allocates what the header says."""
    state = _random_state(3)
    if store.version != 7:  # the store is shared by every example; its header is restored
        store.publish(state, 7)
    path = Path(shm_dir, store.name)
    original = path.read_bytes()[:4096]
    try:
        with open(path, "r+b") as f:
            for word, value in words:
                f.seek(8 * word)
                f.write(struct.pack("=q", value))
        try:
            with WeightReader(store.describe(), directory=shm_dir, max_retries=3) as reader:
                got = reader.read_if_newer(NO_VERSION)
        except (ValueError, TornReadError, NothingPublishedError, WeightsGoneError) as exc:
            assert store.name in str(exc) or "segment" in str(exc)
            return
        if got is not None:
            version, copied = got
            assert version >= 0
            assert {k: v.shape for k, v in copied.items()} == {k: v.shape for k, v in state.items()}
    finally:
        with open(path, "r+b") as f:
            f.write(original)


def test_a_reader_never_follows_a_link_to_a_segment(store: WeightStore, shm_dir: str) -> None:
    store.publish(_random_state(1), 1)
    handle = store.describe()
    elsewhere = Path(shm_dir, "elsewhere")
    elsewhere.mkdir()
    os.replace(Path(shm_dir, store.name), elsewhere / store.name)
    os.symlink(elsewhere / store.name, Path(shm_dir, store.name))
    with pytest.raises(ValueError, match="cannot be opened as a plain file"):
        WeightReader(handle, directory=shm_dir)
    os.unlink(Path(shm_dir, store.name))
    os.replace(elsewhere / store.name, Path(shm_dir, store.name))


def test_buckets_publish_a_version_piece_by_piece(store: WeightStore, shm_dir: str) -> None:
    state = _random_state(11)
    names = list(state)
    with WeightReader(store.describe(), directory=shm_dir) as reader:
        store.publish(_random_state(10), 1)
        seen = []

        def buckets() -> Iterator[dict[str, torch.Tensor]]:
            for part in (names[:2], names[2:5], names[5:]):
                # Readers meanwhile still get the last complete version.
                seen.append(reader.read()[0])
                yield {name: state[name] for name in part}

        store.publish_buckets(buckets(), 2)
        assert seen == [1, 1, 1]
        version, got = reader.read()
    assert version == 2
    _assert_same(got, state)


@pytest.mark.parametrize(
    ("parts", "problem"),
    [
        ([["embed.weight", "nope"]], "nope: unknown"),
        ([["embed.weight"], ["embed.weight"]], "embed.weight: given twice"),
        ([["embed.weight"]], "norm.weight: never given"),
    ],
)
def test_bad_buckets_leave_readers_on_the_last_version(
    store: WeightStore, shm_dir: str, parts: list[list[str]], problem: str
) -> None:
    first, second = _random_state(1), _random_state(2)
    second["nope"] = torch.zeros(1)
    store.publish(first, 1)
    with pytest.raises(ValueError, match=problem):
        store.publish_buckets(({n: second[n] for n in part} for part in parts), 2)
    with WeightReader(store.describe(), directory=shm_dir) as reader:
        version, got = reader.read()
    assert version == 1 and store.version == 1
    _assert_same(got, first)
    # The slot the bad buckets half wrote is simply written again by the next publish.
    store.publish(_random_state(3), 2)
    with WeightReader(store.describe(), directory=shm_dir) as reader:
        assert reader.read()[0] == 2

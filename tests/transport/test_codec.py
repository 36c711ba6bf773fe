"""The codec in one process: round trips, zero-copy frames, shared memory, refusals, bad input.

Messages are encoded with ``Codec.encode`` and decoded with ``decode_envelope`` and
``decode_payload``, as the server and the client do; received frames are simulated by handing the
encoded frames back, or by a real inproc socket where zero copy is the point.
"""

from __future__ import annotations

import gc
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from asyncrl.transport.codec import TORCH_DTYPES, Codec
from asyncrl.transport.errors import (
    DecodeError,
    MessageTooLargeError,
    ProtocolVersionError,
    TensorDescriptorError,
    UnknownKindError,
)
from asyncrl.transport.protocol import (
    PROTOCOL_VERSION,
    TENSOR_EXT,
    Envelope,
    Kind,
    RawEnvelope,
    TensorDesc,
    Where,
)
from asyncrl.transport.shm import ShmPool, ShmReader

# complex32 is usable but torch warns that it is experimental whenever it allocates one.
COMPLEX32_WARNING = "ignore:ComplexHalf support is experimental:UserWarning"


def _has_copy_kernel(dtype: torch.dtype) -> bool:
    try:
        torch.zeros(64, dtype=torch.uint8).view(dtype)[::2].contiguous()
    except RuntimeError:  # NotImplementedError is a RuntimeError
        return False
    return True


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    COPYABLE = {name for name, dtype in TORCH_DTYPES.items() if _has_copy_kernel(dtype)}
# Torch can create every dtype in TORCH_DTYPES and fill it through a uint8 view, so no dtype is
# skipped. The bit-packed int1..int7 and uint1..uint7 have no copy kernel in torch: torch itself
# cannot make a non-contiguous one contiguous, so they are left out of the non-contiguous tests.
NO_COPY_KERNEL = sorted(set(TORCH_DTYPES) - COPYABLE)


class Batch(msgspec.Struct):
    tokens: torch.Tensor
    mask: np.ndarray
    logprobs: list[torch.Tensor]
    extra: dict[str, torch.Tensor]
    step: int


# -- helpers ------------------------------------------------------------------------------


def _filled(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` whose bytes are a known pattern (booleans stay 0 or 1)."""
    nbytes = math.prod(shape) * dtype.itemsize
    pattern = torch.arange(nbytes, dtype=torch.int64) * 7 + 3
    raw = (pattern % 2 if dtype == torch.bool else pattern % 251).to(torch.uint8)
    return raw.view(dtype).view(shape)


def _bytes(t: torch.Tensor) -> bytes:
    """The C-order bytes of a contiguous tensor."""
    assert t.is_contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _encode(codec: Codec, payload: Any, **kw: Any) -> list[Any]:
    frames: list[Any] = codec.encode(
        Envelope(PROTOCOL_VERSION, Kind.REQUEST, 7, "m", payload=payload), **kw
    )
    return frames


def _decode(codec: Codec, frames: list[Any], type_: Any = Any, **kw: Any) -> Any:
    return codec.decode_payload(codec.decode_envelope(frames), frames, type_, **kw)


def _round_trip(payload: Any, type_: Any = Any) -> tuple[Any, RawEnvelope, list[Any]]:
    """Encode ``payload`` with a fresh codec and decode it with another."""
    frames = _encode(Codec(), payload)
    receiver = Codec()
    env = receiver.decode_envelope(frames)
    return receiver.decode_payload(env, frames, type_), env, frames


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def _tampered(frames: list[Any], index: int = 0, **changes: Any) -> list[Any]:
    """``frames`` with descriptor ``index`` changed; the payload is kept as it was."""
    env = msgspec.msgpack.decode(frames[0], type=Envelope)
    env.tensors[index] = msgspec.structs.replace(env.tensors[index], **changes)
    return [msgspec.msgpack.encode(env), *frames[1:]]


def _message(payload: Any, descs: list[TensorDesc], *frames: bytes) -> list[Any]:
    """A hand-written message: an envelope with these descriptors, and these frames."""
    env = Envelope(PROTOCOL_VERSION, Kind.REQUEST, 7, "m", payload=payload, tensors=descs)
    return [msgspec.msgpack.encode(env), *frames]


def _ref(index: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(TENSOR_EXT, index.to_bytes(4, "little"))


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    """A private directory standing in for /dev/shm, so nothing leaks between tests."""
    return str(tmp_path)


@pytest.fixture
def pool(shm_dir: str) -> Iterator[ShmPool]:
    pool = ShmPool("codec", directory=shm_dir)
    yield pool
    pool.close()


# -- every torch dtype --------------------------------------------------------------------


@pytest.mark.filterwarnings(COMPLEX32_WARNING)
@pytest.mark.parametrize(
    ("shape", "where"),
    [((2, 3), Where.INLINE), ((48, 32), Where.FRAME)],  # 6 to 96 bytes; 1536 to 24576 bytes
    ids=["inline", "frame"],
)
@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_every_torch_dtype_round_trips(name: str, shape: tuple[int, ...], where: Where) -> None:
    dtype = TORCH_DTYPES[name]
    t = _filled(dtype, shape)
    decoded, env, frames = _round_trip({"t": t})
    [desc] = env.tensors
    assert (desc.lib, desc.dtype, desc.shape, desc.where) == ("torch", name, list(shape), where)
    assert desc.nbytes == math.prod(shape) * dtype.itemsize
    assert len(frames) == (2 if where == Where.FRAME else 1)
    out = decoded["t"]
    assert isinstance(out, torch.Tensor)
    assert (out.dtype, out.shape, out.device.type) == (dtype, t.shape, "cpu")
    assert _bytes(out) == _bytes(t)


@pytest.mark.filterwarnings(COMPLEX32_WARNING)
@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_every_torch_dtype_round_trips_through_shared_memory(
    name: str, pool: ShmPool, shm_dir: str
) -> None:
    dtype = TORCH_DTYPES[name]
    t = _filled(dtype, (64, 64))
    sender = Codec(shm_threshold=1024, shm_pool=pool)
    receiver = Codec(shm_reader=ShmReader(shm_dir))
    frames = _encode(sender, t, use_shm=True)
    env = receiver.decode_envelope(frames)
    [desc] = env.tensors
    assert (desc.where, desc.dtype, desc.segment) == (Where.SHM, name, pool.segment_names()[0])
    out = receiver.decode_payload(env, frames, torch.Tensor)
    assert (out.dtype, out.shape) == (dtype, t.shape)
    assert _bytes(out) == _bytes(t)


def test_non_contiguous_tensors_through_shared_memory(pool: ShmPool, shm_dir: str) -> None:
    sender = Codec(shm_threshold=1024, shm_pool=pool)
    receiver = Codec(shm_reader=ShmReader(shm_dir))
    base = _filled(torch.bfloat16, (64, 48))
    views = {"transposed": base.t(), "columns": base[:, ::2]}
    frames = _encode(sender, views, use_shm=True)
    env = receiver.decode_envelope(frames)
    assert [d.where for d in env.tensors] == [Where.SHM, Where.SHM]
    out = receiver.decode_payload(env, frames)
    for key, view in views.items():
        assert out[key].shape == view.shape, key
        assert _bytes(out[key]) == _bytes(view.contiguous()), key


@pytest.mark.parametrize("name", NO_COPY_KERNEL)
def test_a_non_contiguous_bit_packed_tensor_is_refused_before_shared_memory(
    name: str, pool: ShmPool
) -> None:
    sender = Codec(shm_threshold=1024, shm_pool=pool)
    t = _filled(TORCH_DTYPES[name], (64, 64)).t()
    with pytest.raises(TypeError) as err:
        _encode(sender, t, use_shm=True)
    assert str(err.value).startswith(f"cannot encode a tensor of dtype torch.{name}: ")
    assert isinstance(err.value.__cause__, NotImplementedError)
    assert pool.lent == 0 and sender.last_slots == []  # the slot went back


# -- layouts: non-contiguous, zero-dimensional, empty ----------------------------------------


@pytest.mark.filterwarnings(COMPLEX32_WARNING)
@pytest.mark.parametrize("name", sorted(COPYABLE))
def test_non_contiguous_tensors_travel_as_their_values(name: str) -> None:
    base = _filled(TORCH_DTYPES[name], (48, 32))
    views = {
        "transposed": base.t(),  # over 1024 bytes for every dtype: a frame
        "rows": base[::3],
        "columns": base[:, 1::2],
        "offset": base[5:9],  # contiguous, but not at the start of its storage
        "expanded": base[0].expand(40, 32),  # stride 0
        "small": base[:3, ::5],  # under 1024 bytes for every dtype: inline
    }
    assert not views["transposed"].is_contiguous() and views["offset"].storage_offset() == 160
    decoded, env, _ = _round_trip(views)
    assert [d.where for d in env.tensors] == [
        Where.INLINE if v.numel() * v.element_size() <= 1024 else Where.FRAME
        for v in views.values()
    ]
    assert env.tensors[0].where == Where.FRAME and env.tensors[-1].where == Where.INLINE
    for key, view in views.items():
        out = decoded[key]
        assert out.shape == view.shape, key
        assert out.is_contiguous(), key
        assert _bytes(out) == _bytes(view.contiguous()), key


@pytest.mark.parametrize("name", NO_COPY_KERNEL)
def test_a_non_contiguous_bit_packed_tensor_is_refused(name: str) -> None:
    t = _filled(TORCH_DTYPES[name], (4, 6)).t()
    with pytest.raises(TypeError) as err:
        _encode(Codec(), t)
    assert str(err.value).startswith(f"cannot encode a tensor of dtype torch.{name}: ")
    assert isinstance(err.value.__cause__, NotImplementedError)


def test_conjugate_views_travel_resolved() -> None:
    z = torch.complex(torch.arange(6.0), torch.arange(6.0) + 10).view(2, 3)
    conj = z.conj()
    assert conj.is_conj()
    decoded, _, _ = _round_trip(conj)
    assert not decoded.is_conj()
    assert torch.equal(decoded, torch.conj_physical(z))


def test_zero_dimensional_tensors_and_arrays() -> None:
    payload: dict[str, Any] = {
        "f": torch.tensor(3.5),
        "b": torch.tensor(True),
        "bf": torch.tensor(-2.0, dtype=torch.bfloat16),
        "n": np.array(-7, dtype=">i8"),
    }
    decoded, env, frames = _round_trip(payload)
    assert len(frames) == 1
    assert [(d.shape, d.where) for d in env.tensors] == [([], Where.INLINE)] * 4
    assert [d.nbytes for d in env.tensors] == [4, 1, 2, 8]
    for key in ("f", "b", "bf"):
        assert decoded[key].shape == torch.Size([]), key
        assert decoded[key].dtype == payload[key].dtype, key
        assert decoded[key].item() == payload[key].item(), key
    assert decoded["n"].shape == () and decoded["n"].dtype == np.dtype(">i8")
    assert int(decoded["n"]) == -7


@pytest.mark.filterwarnings(COMPLEX32_WARNING)
@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_empty_tensors_of_every_dtype(name: str) -> None:
    t = torch.empty((0, 3), dtype=TORCH_DTYPES[name])
    decoded, env, frames = _round_trip(t)
    assert len(frames) == 1
    assert env.tensors == [TensorDesc("torch", name, [0, 3], 0, Where.INLINE)]
    assert (decoded.dtype, decoded.shape) == (t.dtype, torch.Size([0, 3]))


def test_empty_arrays() -> None:
    a = np.empty((0, 3), dtype=">f8")
    decoded, env, _ = _round_trip([a, np.empty((5, 0), dtype=np.int16)])
    assert [(d.dtype, d.shape, d.nbytes, d.where) for d in env.tensors] == [
        (">f8", [0, 3], 0, Where.INLINE),
        ("<i2", [5, 0], 0, Where.INLINE),
    ]
    assert (decoded[0].dtype, decoded[0].shape) == (np.dtype(">f8"), (0, 3))
    assert (decoded[1].dtype, decoded[1].shape) == (np.dtype("<i2"), (5, 0))


# -- numpy --------------------------------------------------------------------------------

NUMPY_DTYPES = [
    "<f4",
    ">f4",
    "<f8",
    ">f8",
    "<f2",
    "<i2",
    ">i4",
    ">u8",
    "|u1",
    "|i1",
    "|b1",
    "<c8",
    ">c16",
    ">M8[ns]",
    "<m8[s]",
]


@pytest.mark.parametrize("count", [10, 2000], ids=["inline", "frame"])
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_keep_dtype_and_byte_order(dtype: str, count: int) -> None:
    a = np.frombuffer(bytes(range(256)) * (count * 16 // 256 + 1), dtype=np.uint8)
    a = a[: count * np.dtype(dtype).itemsize].view(dtype).reshape(count // 10, 10)
    if dtype == "|b1":
        a = a.view(np.uint8) % 2 == 1
    decoded, env, frames = _round_trip(a)
    [desc] = env.tensors
    assert (desc.lib, desc.dtype, desc.shape) == ("numpy", np.dtype(dtype).str, [count // 10, 10])
    assert desc.where == (Where.INLINE if a.nbytes <= 1024 else Where.FRAME)
    wire = desc.data if desc.where == Where.INLINE else bytes(frames[desc.frame])
    assert wire == a.tobytes()  # the sender's byte order travels as is
    assert decoded.dtype == a.dtype and decoded.dtype.str == np.dtype(dtype).str
    assert decoded.tobytes() == a.tobytes()


def test_non_contiguous_numpy_arrays() -> None:
    a = np.arange(2000, dtype=">f8").reshape(40, 50)
    views = {"T": a.T, "rows": a[::2], "cols": a[:, 3::7], "fortran": np.asfortranarray(a)}
    decoded, env, _ = _round_trip(views)
    assert [d.where for d in env.tensors] == [Where.FRAME, Where.FRAME, Where.FRAME, Where.FRAME]
    for key, view in views.items():
        assert decoded[key].dtype.str == ">f8", key
        assert decoded[key].flags.c_contiguous, key
        np.testing.assert_array_equal(decoded[key], view)


def test_numpy_scalars_travel_as_plain_values() -> None:
    decoded, env, _ = _round_trip({"i": np.int64(3), "f": np.float32(1.5), "b": np.bool_(True)})
    assert decoded == {"i": 3, "f": 1.5, "b": True}
    assert env.tensors == []


# -- tensors inside structures ------------------------------------------------------------


def test_tensors_inside_a_struct_decode_typed() -> None:
    batch = Batch(
        tokens=torch.arange(1000, dtype=torch.int64).view(10, 100),  # 8000 bytes: a frame
        mask=np.array([True, False, True]),  # inline
        logprobs=[torch.full((3,), -0.5), torch.linspace(0, 1, 500)],  # inline, frame
        extra={"values": torch.ones(2, 2, dtype=torch.bfloat16)},
        step=41,
    )
    frames = _encode(Codec(), batch)
    receiver = Codec()
    env = receiver.decode_envelope(frames)
    assert [(d.lib, d.where, d.frame) for d in env.tensors] == [
        ("torch", Where.FRAME, 1),
        ("numpy", Where.INLINE, 0),
        ("torch", Where.INLINE, 0),
        ("torch", Where.FRAME, 2),
        ("torch", Where.INLINE, 0),
    ]
    out = receiver.decode_payload(env, frames, Batch)
    assert isinstance(out, Batch)
    assert torch.equal(out.tokens, batch.tokens)
    np.testing.assert_array_equal(out.mask, batch.mask)
    assert len(out.logprobs) == 2
    assert all(torch.equal(x, y) for x, y in zip(out.logprobs, batch.logprobs, strict=True))
    assert list(out.extra) == ["values"] and torch.equal(out.extra["values"], batch.extra["values"])
    assert out.step == 41


def test_tensors_inside_lists_and_dicts() -> None:
    payload = {
        "a": [torch.zeros(3), {"b": np.arange(4, dtype="<u2"), "c": [torch.ones(1, 1)]}],
        "d": (torch.tensor([1, 2, 3]), "text", 5),
        "e": None,
    }
    decoded, env, _ = _round_trip(payload)
    assert len(env.tensors) == 4
    assert torch.equal(decoded["a"][0], torch.zeros(3))
    np.testing.assert_array_equal(decoded["a"][1]["b"], np.arange(4, dtype="<u2"))
    assert torch.equal(decoded["a"][1]["c"][0], torch.ones(1, 1))
    assert torch.equal(decoded["d"][0], torch.tensor([1, 2, 3]))
    assert decoded["d"][1:] == ["text", 5]  # a tuple comes back as a list
    assert decoded["e"] is None


def test_more_tensors_than_the_cached_references() -> None:
    tensors = [torch.full((2,), float(i)) for i in range(100)]
    decoded, env, _ = _round_trip(tensors)
    assert len(env.tensors) == 100
    assert [float(t[0]) for t in decoded] == [float(i) for i in range(100)]


def test_a_tensor_of_the_wrong_kind_for_the_struct_is_a_decode_error() -> None:
    class Only(msgspec.Struct):
        t: torch.Tensor

    frames = _encode(Codec(), {"t": np.zeros(2)})
    with pytest.raises(DecodeError) as err:
        _decode(Codec(), frames, Only)
    assert type(err.value) is DecodeError
    assert str(err.value) == "payload of m: expected Tensor, got ndarray - at `$.t`"


# -- where the bytes travel ---------------------------------------------------------------


def test_the_inline_threshold_is_inclusive() -> None:
    at, over = torch.zeros(1024, dtype=torch.uint8), torch.zeros(1025, dtype=torch.uint8)
    _, env, frames = _round_trip([at, over])
    assert [d.where for d in env.tensors] == [Where.INLINE, Where.FRAME]
    assert env.tensors[0].data == bytes(1024)
    assert (env.tensors[1].frame, len(frames), len(frames[1])) == (1, 2, 1025)


def test_large_tensors_are_sent_without_copying() -> None:
    t = torch.arange(4096, dtype=torch.float32)
    a = np.arange(3000, dtype=">i4")
    frames = _encode(Codec(), {"t": t, "a": a})
    assert len(frames) == 3
    # The frames handed to zmq are views of the tensors' own memory.
    assert _address(frames[1]) == t.data_ptr()
    assert _address(frames[2]) == a.ctypes.data


def test_large_tensors_decode_as_views_of_the_received_frames() -> None:
    t = torch.arange(4096, dtype=torch.float32)  # 16 KiB
    a = np.arange(3000, dtype=">i4")  # 12 KiB
    ctx = zmq.Context()
    sender, receiver_sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        receiver_sock.bind("inproc://codec")
        sender.connect("inproc://codec")
        sender.send_multipart(_encode(Codec(), {"t": t, "a": a}), copy=False)
        assert receiver_sock.poll(5000) == zmq.POLLIN
        received: list[Any] = receiver_sock.recv_multipart(copy=False)
    finally:
        sender.close(linger=0)
        receiver_sock.close(linger=0)
        ctx.term()
    assert all(isinstance(f, zmq.Frame) for f in received)
    received[0] = received[0].bytes  # the server and client read the envelope as bytes
    receiver = Codec()
    out = receiver.decode_payload(receiver.decode_envelope(received), received)
    assert torch.equal(out["t"], t)
    np.testing.assert_array_equal(out["a"], a)

    for frame, start, nbytes in (
        (received[1], out["t"].data_ptr(), out["t"].nbytes),
        (received[2], out["a"].ctypes.data, out["a"].nbytes),
    ):
        base = _address(frame.buffer)
        assert base <= start and start + nbytes <= base + len(frame)
    # The same memory: a change to the frame shows in the tensor.
    np.frombuffer(received[1].buffer, dtype=np.float32)[7] = -1.0
    assert out["t"][7].item() == -1.0

    # The decoded values keep the frames alive once the message is dropped.
    del received
    gc.collect()
    assert out["t"][8].item() == 8.0 and out["a"][-1] == 2999


# -- shared memory ------------------------------------------------------------------------


def test_shared_memory_tensors_are_read_in_place_and_released_with_the_last_view(
    pool: ShmPool, shm_dir: str
) -> None:
    sender = Codec(shm_threshold=4096, shm_pool=pool)
    receiver = Codec(shm_reader=ShmReader(shm_dir))
    t = torch.arange(2048, dtype=torch.float32)  # 8 KiB
    a = np.arange(1024, dtype=">f8")  # 8 KiB
    small = torch.arange(10)
    frames = _encode(sender, {"t": t, "a": a, "small": small}, peer=b"peer-1", use_shm=True)
    assert len(frames) == 1  # nothing of the shared-memory tensors travels in the message
    slot_t, slot_a = sender.last_slots
    assert pool.lent == 2

    env = receiver.decode_envelope(frames)
    desc_t, desc_a, desc_small = env.tensors
    assert (desc_t.where, desc_t.slot, desc_t.offset, desc_t.nbytes) == (Where.SHM, slot_t, 0, 8192)
    assert (desc_a.where, desc_a.slot, desc_a.dtype) == (Where.SHM, slot_a, ">f8")
    assert desc_small.where == Where.INLINE
    assert sorted(pool.segment_names()) == sorted([desc_t.segment, desc_a.segment])

    released: list[int] = []
    out = receiver.decode_payload(env, frames, Any, released.append)
    assert torch.equal(out["t"], t)
    np.testing.assert_array_equal(out["a"], a)

    # Read in place: a write through the decoded tensor shows in the segment itself.
    out["t"][3] = 99.0
    segment = ShmReader(shm_dir).view(desc_t.segment, 0, 8192).view(np.float32)
    assert segment[3] == 99.0

    # The slot goes back when the last view of it goes, not before, and exactly once.
    tensor = out.pop("t")
    part = tensor[100:200]
    del tensor
    gc.collect()
    assert released == []
    del part
    gc.collect()
    assert released == [slot_t]
    column = out.pop("a").reshape(32, 32)[:, 0]
    gc.collect()
    assert released == [slot_t]
    del column
    gc.collect()
    assert released == [slot_t, slot_a]
    del out, segment
    gc.collect()
    assert released == [slot_t, slot_a]

    # The sender takes the slots back and reuses the same segments.
    assert pool.release(slot_t) and pool.release(slot_a)
    assert pool.lent == 0
    again = receiver.decode_envelope(_encode(sender, t, peer=b"peer-1", use_shm=True))
    assert again.tensors[0].segment in (desc_t.segment, desc_a.segment)
    assert len(pool.segment_names()) == 2


def test_shared_memory_only_when_asked_and_over_the_threshold(pool: ShmPool) -> None:
    sender = Codec(shm_threshold=4096, shm_pool=pool)
    frames = _encode(sender, torch.zeros(2048))  # 8192 bytes, but use_shm is False
    assert Codec().decode_envelope(frames).tensors[0].where == Where.FRAME
    frames = _encode(sender, torch.zeros(1023), use_shm=True)  # 4092 bytes: under
    assert Codec().decode_envelope(frames).tensors[0].where == Where.FRAME
    assert pool.lent == 0 and pool.segment_names() == []


def test_a_full_pool_falls_back_to_frames(shm_dir: str) -> None:
    pool = ShmPool("full", max_bytes=0, directory=shm_dir)
    try:
        sender = Codec(shm_threshold=4096, shm_pool=pool)
        t = torch.arange(2048, dtype=torch.float32)
        frames = _encode(sender, t, use_shm=True)
        env = Codec().decode_envelope(frames)
        assert env.tensors[0].where == Where.FRAME and len(frames) == 2
        assert pool.fallbacks == 1 and sender.last_slots == []
        assert torch.equal(Codec().decode_payload(env, frames), t)
    finally:
        pool.close()


def test_a_failed_encode_gives_its_slots_back(pool: ShmPool) -> None:
    sender = Codec(shm_threshold=4096, shm_pool=pool)
    with pytest.raises(TypeError, match="cannot encode a value of type object"):
        _encode(sender, [torch.zeros(2048), object()], use_shm=True)
    assert pool.lent == 0 and sender.last_slots == []
    assert len(pool.segment_names()) == 1  # kept for the next message


def test_a_receiver_without_shared_memory_refuses_it(pool: ShmPool) -> None:
    frames = _encode(Codec(shm_threshold=4096, shm_pool=pool), torch.zeros(2048), use_shm=True)
    with pytest.raises(TensorDescriptorError) as err:
        _decode(Codec(), frames)
    assert str(err.value) == (
        "tensor 0 (torch float32 [2048]): sent through shared memory, which this receiver refused"
    )


def test_shared_memory_descriptors_that_do_not_hold(pool: ShmPool, shm_dir: str) -> None:
    frames = _encode(Codec(shm_threshold=4096, shm_pool=pool), torch.zeros(2048), use_shm=True)
    [segment] = pool.segment_names()
    receiver = Codec(shm_reader=ShmReader(shm_dir))

    bad = _tampered(frames, segment="../etc/passwd")
    with pytest.raises(TensorDescriptorError) as err:
        _decode(receiver, bad)
    assert str(err.value) == (
        "shared-memory tensor: '../etc/passwd' is not an asyncrl shared-memory segment name"
    )

    bad = _tampered(frames, offset=(1 << 20) - 4096)
    with pytest.raises(TensorDescriptorError) as err:
        _decode(receiver, bad)
    assert str(err.value) == (
        f"shared-memory tensor: range [1044480, 1052672) lies outside segment {segment} of "
        f"1048576 bytes"
    )

    pool.close()  # the sender unlinked it
    with pytest.raises(TensorDescriptorError) as err:
        _decode(Codec(shm_reader=ShmReader(shm_dir)), frames)
    assert str(err.value) == (
        f"shared-memory tensor: [Errno 2] No such file or directory: "
        f"'{os.path.join(shm_dir, segment)}'"
    )
    assert isinstance(err.value.__cause__, FileNotFoundError)


# -- what cannot travel -------------------------------------------------------------------


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized creation is deprecated in torch
        return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            torch.empty(3, device="meta"),
            "cannot encode a tensor on meta: the transport carries CPU tensors; call .cpu() "
            "first, or move it with the hardware plugin's broadcast",
        ),
        (
            torch.eye(3).to_sparse(),
            "cannot encode a torch.sparse_coo tensor; call .to_dense() first",
        ),
        (_quantized(), "cannot encode a tensor of dtype torch.qint8"),
        (
            np.array([object(), 1]),
            "cannot encode a numpy array of dtype object: object and structured arrays do not "
            "travel; use a plain numeric dtype",
        ),
        (
            np.zeros(2, dtype="f4,i4"),
            "cannot encode a numpy array of dtype [('f0', '<f4'), ('f1', '<i4')]: object and "
            "structured arrays do not travel; use a plain numeric dtype",
        ),
        (
            object(),
            "cannot encode a value of type object: payloads hold msgspec Structs, builtins, "
            "torch CPU tensors and numpy arrays",
        ),
    ],
    ids=["meta", "sparse", "quantized", "object-array", "structured-array", "object"],
)
def test_values_that_cannot_travel_are_refused(value: Any, message: str) -> None:
    codec = Codec()
    with pytest.raises(TypeError) as err:
        _encode(codec, {"x": [1, value]})
    assert type(err.value) is TypeError
    assert str(err.value) == message
    # The codec is still good for the next message.
    assert torch.equal(_decode(Codec(), _encode(codec, torch.ones(2))), torch.ones(2))


# -- descriptors that disagree with the bytes ---------------------------------------------


def _inline_frames() -> list[Any]:
    return _encode(Codec(), torch.arange(6, dtype=torch.float32).view(2, 3))  # 24 bytes


def _frame_frames() -> list[Any]:
    return _encode(Codec(), torch.zeros(512))  # 2048 bytes, frame 1


@pytest.mark.parametrize(
    ("frames", "changes", "message"),
    [
        (
            _inline_frames,
            {"nbytes": 20},
            "tensor 0 (torch float32 [2, 3]): nbytes is 20, but shape and dtype need 24",
        ),
        (
            _inline_frames,
            {"shape": [2, 2], "nbytes": 16},
            "tensor 0 (torch float32 [2, 2]): descriptor needs 16 bytes, the message carries 24",
        ),
        (
            _inline_frames,
            {"dtype": "float64", "nbytes": 48},
            "tensor 0 (torch float64 [2, 3]): descriptor needs 48 bytes, the message carries 24",
        ),
        (
            _inline_frames,
            {"dtype": "float33"},
            "tensor 0 (torch float33 [2, 3]): unknown torch dtype 'float33'",
        ),
        (
            _inline_frames,
            {"lib": "numpy", "dtype": "<f3"},
            "tensor 0 (numpy <f3 [2, 3]): unknown numpy dtype '<f3'",
        ),
        (
            _inline_frames,
            {"lib": "numpy", "dtype": "|O"},
            "tensor 0 (numpy |O [2, 3]): numpy dtype '|O' cannot travel",
        ),
        (
            _inline_frames,
            {"lib": "numpy", "dtype": "(2,)<f4", "nbytes": 48},
            "tensor 0 (numpy (2,)<f4 [2, 3]): numpy dtype '(2,)<f4' cannot travel",
        ),
        (
            _inline_frames,
            {"lib": "jax"},
            "tensor 0 (jax float32 [2, 3]): unknown library 'jax'; expected torch or numpy",
        ),
        (
            _inline_frames,
            {"shape": [-2, -3]},
            "tensor 0 (torch float32 [-2, -3]): negative dimension in shape",
        ),
        (_inline_frames, {"where": 7}, "tensor 0 (torch float32 [2, 3]): unknown location 7"),
        (
            _frame_frames,
            {"frame": 2},
            "tensor 0 (torch float32 [512]): points at frame 2, but the message has frames 1..1",
        ),
        (
            _frame_frames,
            {"frame": 0},
            "tensor 0 (torch float32 [512]): points at frame 0, but the message has frames 1..1",
        ),
        (
            _frame_frames,
            {"shape": [256], "nbytes": 1024},
            "tensor 0 (torch float32 [256]): descriptor needs 1024 bytes, the message carries 2048",
        ),
        (
            _frame_frames,
            {"dtype": "int8", "nbytes": 512},
            "tensor 0 (torch int8 [512]): descriptor needs 512 bytes, the message carries 2048",
        ),
    ],
    ids=[
        "nbytes",
        "shape",
        "dtype",
        "unknown-torch-dtype",
        "unknown-numpy-dtype",
        "object-dtype",
        "subarray-dtype",
        "library",
        "negative-dims",
        "location",
        "frame-past-end",
        "frame-zero",
        "frame-shape",
        "frame-dtype",
    ],
)
def test_descriptors_that_disagree_with_the_bytes(
    frames: Any, changes: dict[str, Any], message: str
) -> None:
    bad = _tampered(frames(), **changes)
    receiver = Codec()
    env = receiver.decode_envelope(bad)
    with pytest.raises(TensorDescriptorError) as err:
        receiver.decode_payload(env, bad, torch.Tensor)
    assert type(err.value) is TensorDescriptorError
    assert str(err.value) == message


def test_references_to_tensors_that_are_not_described() -> None:
    desc = TensorDesc("torch", "float32", [1], 4, Where.INLINE, data=bytes(4))
    receiver = Codec()
    cases = [
        (
            _message([_ref(0), _ref(3)], [desc]),
            "payload refers to tensor 3, but the envelope describes 1",
        ),
        (_message({"x": _ref(0)}, []), "payload refers to tensor 0, but the envelope describes 0"),
        (_message(msgspec.msgpack.Ext(2, b"abcd"), [desc]), "unknown extension type 2 in payload"),
    ]
    for frames, message in cases:
        with pytest.raises(TensorDescriptorError) as err:
            _decode(receiver, frames)
        assert type(err.value) is TensorDescriptorError
        assert str(err.value) == message


def test_descriptors_with_too_many_dimensions_are_refused_before_any_work() -> None:
    desc = TensorDesc("numpy", "<f4", [1] * 65, 4, Where.INLINE, data=bytes(4))
    with pytest.raises(TensorDescriptorError) as err:
        _decode(Codec(), _message(_ref(0), [desc]))
    assert str(err.value) == "tensor 0 (numpy <f4): shape has 65 dimensions, over the limit of 64"


# -- envelopes that do not hold -----------------------------------------------------------


def test_a_message_over_the_size_limit() -> None:
    frames = _encode(Codec(), torch.zeros(512))  # frame 1 is 2048 bytes
    size = len(frames[0]) + 2048
    Codec(max_message_bytes=size).decode_envelope(frames)  # at the limit: accepted
    with pytest.raises(MessageTooLargeError) as err:
        Codec(max_message_bytes=size - 1).decode_envelope(frames)
    assert str(err.value) == (
        f"message of {size} bytes exceeds the limit of {size - 1} bytes; send less per message "
        f"or raise max_message_bytes on the receiver"
    )


@pytest.mark.parametrize("kind", [0, 13, 99, 255])
def test_unknown_kinds(kind: int) -> None:
    frames = Codec().encode(Envelope(PROTOCOL_VERSION, kind, 3))
    with pytest.raises(UnknownKindError) as err:
        Codec().decode_envelope(frames)
    assert str(err.value) == (
        f"unknown envelope kind {kind}; known kinds are 1 (HANDSHAKE), 2 (WELCOME), "
        f"3 (REQUEST), 4 (REPLY), 5 (ERROR), 6 (CREDIT), 7 (PING), 8 (PONG), 9 (STOP), "
        f"10 (RELEASE), 11 (MESSAGE), 12 (BATCH)"
    )


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"garbage", "Expected `array`, got `int`"),
        (b"", "Input data was truncated"),
        (b"\xc1", "MessagePack data is malformed: invalid opcode '\\xc1' (byte 0)"),
        (msgspec.msgpack.encode({"version": 1}), "Expected `array`, got `object`"),
        (msgspec.msgpack.encode([1]), "Expected `array` of at least length 2, got 1"),
        (msgspec.msgpack.encode([1, 3, "x"]), "Expected `int`, got `str` - at `$[2]`"),
        (msgspec.msgpack.encode([1.0, 3]), "Expected `int`, got `float` - at `$[0]`"),
    ],
    ids=["garbage", "empty", "bad-opcode", "map", "too-short", "wrong-type", "float-version"],
)
def test_garbage_in_frame_zero(frame: bytes, message: str) -> None:
    with pytest.raises(DecodeError) as err:
        Codec().decode_envelope([frame])
    assert type(err.value) is DecodeError
    assert str(err.value) == f"frame 0 is not a valid envelope: {message}"


def test_an_empty_message() -> None:
    with pytest.raises(DecodeError) as err:
        Codec().decode_envelope([])
    assert str(err.value) == "empty message: expected at least the envelope frame"


DEEP = b"\x91" * 5000 + b"\xc0"  # 5 KB, nested 5000 deep


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (DEEP, "Expected `array` of at least length 2, got 1"),
        # A 10-position envelope whose payload (position 8) is too deep even to skip.
        (
            b"\x9a" + msgspec.msgpack.encode([1, 3, 7, "add", 0.0, 0, 0, ""])[1:] + DEEP + b"\x90",
            "maximum recursion depth exceeded while deserializing an object",
        ),
    ],
    ids=["frame", "payload"],
)
def test_deeply_nested_input_is_a_decode_error(frame: bytes, message: str) -> None:
    with pytest.raises(DecodeError) as err:
        Codec().decode_envelope([frame])
    assert type(err.value) is DecodeError
    assert str(err.value) == f"frame 0 is not a valid envelope: {message}"


@pytest.mark.parametrize(
    "frame",
    [
        Codec().encode(Envelope(2, Kind.REQUEST, 5, "add", payload={"a": 1}))[0],
        msgspec.msgpack.encode([2, 3, "another layout"]),
        msgspec.msgpack.encode([0, 99]),
    ],
    ids=["version-2", "version-2-other-layout", "version-0"],
)
def test_another_protocol_version(frame: bytes) -> None:
    theirs = msgspec.msgpack.decode(frame)[0]
    with pytest.raises(ProtocolVersionError) as err:
        Codec().decode_envelope([frame])
    assert (err.value.ours, err.value.theirs) == (PROTOCOL_VERSION, theirs)
    assert str(err.value) == (
        f"protocol version mismatch: this side speaks version 1, the peer speaks version "
        f"{theirs}; run the same asyncrl protocol version on both ends"
    )


def test_a_short_envelope_takes_the_defaults() -> None:
    env = Codec().decode_envelope([msgspec.msgpack.encode([PROTOCOL_VERSION, Kind.PING, 13])])
    assert (env.kind, env.id, env.method, env.deadline, env.tensors) == (Kind.PING, 13, "", 0.0, [])


def test_a_payload_of_the_wrong_type() -> None:
    with pytest.raises(DecodeError) as err:
        _decode(Codec(), _encode(Codec(), "text"), int)
    assert str(err.value) == "payload of m: Expected `int`, got `str`"
    frames = Codec().encode(Envelope(PROTOCOL_VERSION, Kind.ERROR, 1, payload="text"))
    with pytest.raises(DecodeError) as err:
        _decode(Codec(), frames, int)
    assert str(err.value) == "payload of ERROR: Expected `int`, got `str`"

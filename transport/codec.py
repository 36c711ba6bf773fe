"""The codec: one envelope plus any number of tensors, to and from a list of ZeroMQ frames.

Tensors (torch CPU tensors of every dtype, and numpy arrays) may sit anywhere inside a payload.
While the envelope is encoded, each tensor is replaced by a MessagePack extension value holding an
index into ``Envelope.tensors``, and its bytes travel by size:

- up to ``inline_threshold`` bytes: inside the descriptor;
- larger: as a separate frame, sent without copying and decoded as a view of the received frame;
- from ``shm_threshold`` bytes, when the peer accepted shared memory: through a slot of the
  sender's ``ShmPool``, read in place by the receiver, and released when the last tensor that
  views it is garbage-collected.

Decoding is two steps: ``decode_envelope`` reads frame 0 and checks size, version and kind;
``decode_payload`` decodes the payload into the type the receiver expects and rebuilds tensors,
checking every descriptor against the bytes it points to.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

from .errors import (
    DecodeError,
    MessageTooLargeError,
    ProtocolVersionError,
    TensorDescriptorError,
    UnknownKindError,
)
from .protocol import (
    MAX_DIM,
    MAX_DIMS,
    PROTOCOL_VERSION,
    TENSOR_EXT,
    Envelope,
    EnvelopeHead,
    Kind,
    RawEnvelope,
    TensorDesc,
    Where,
)
from .shm import ShmPool, ShmReader

__all__ = ["Codec", "Frames", "dec_hook", "torch_dtypes"]

Frames = Sequence[Any]
"""A received message: bytes or ``zmq.Frame`` objects (both support ``len`` and the buffer
protocol)."""


_torch_dtypes: dict[str, torch.dtype] | None = None


def _torch() -> Any:
    """The torch module, imported on first use by a local caller (never because of a peer).

    A process that never meets a tensor (the node agent) never imports torch: a payload can hold
    a torch tensor only if torch is already imported. A torch descriptor arriving in a process
    without torch is refused (see ``_itemsize``), since importing torch would block the event
    loop for a second or more on a peer's say-so.
    """
    import torch

    return torch


def torch_dtypes() -> dict[str, torch.dtype]:
    """Torch dtypes that travel, by their wire name: all but the quantized ones. The bit-packed
    dtypes (``uint1``..``uint7``, ``int1``..``int7``, ``bits*``) travel as their bytes, one byte
    an element."""
    global _torch_dtypes
    if _torch_dtypes is None:
        torch = _torch()
        _torch_dtypes = {
            str(value).removeprefix("torch."): value
            for value in vars(torch).values()
            if isinstance(value, torch.dtype) and not str(value).startswith("torch.q")
        }
    return _torch_dtypes


def __getattr__(name: str) -> Any:
    if name == "TORCH_DTYPES":  # kept as a module attribute, computed when first asked for
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_KINDS = frozenset(int(k) for k in Kind)
_MESSAGE = int(Kind.MESSAGE)
_EXT_INDEX = [msgspec.msgpack.Ext(TENSOR_EXT, i.to_bytes(4, "little")) for i in range(64)]


def _ext_for(index: int) -> msgspec.msgpack.Ext:
    if index < len(_EXT_INDEX):
        return _EXT_INDEX[index]
    return msgspec.msgpack.Ext(TENSOR_EXT, index.to_bytes(4, "little"))


def _shape_nbytes(shape: list[int], itemsize: int) -> int:
    return math.prod(shape) * itemsize


class Codec:
    """Encodes and decodes messages for one channel. Not thread-safe: one per socket.

    Args:
        inline_threshold: tensors up to this many bytes travel inside the descriptor.
        shm_threshold: tensors from this many bytes go through shared memory when allowed.
        max_message_bytes: larger received messages are refused with MessageTooLargeError.
        shm_pool: the sender's pool; None disables sending through shared memory.
        shm_reader: the receiver's mapper; None refuses shared-memory descriptors.
    """

    def __init__(
        self,
        *,
        inline_threshold: int = 1024,
        shm_threshold: int = 1 << 20,
        max_message_bytes: int = 1 << 31,
        shm_pool: ShmPool | None = None,
        shm_reader: ShmReader | None = None,
    ) -> None:
        self.inline_threshold = inline_threshold
        self.shm_threshold = shm_threshold
        self.max_message_bytes = max_message_bytes
        self.shm_pool = shm_pool
        self.shm_reader = shm_reader
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._raw_decoder = msgspec.msgpack.Decoder(RawEnvelope)
        self._head_decoder = msgspec.msgpack.Decoder(EnvelopeHead)
        self._int_decoder = msgspec.msgpack.Decoder(int)
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
        # Per-message state of the encode and decode hooks.
        self._frames: list[Any] = []
        self._descs: list[TensorDesc] = []
        self._peer = b""
        self._use_shm = False
        self.last_slots: list[int] = []
        self._in_env: RawEnvelope | None = None
        self._in_frames: Frames = ()
        self._on_release: Callable[[int], None] | None = None

    # -- encoding -------------------------------------------------------------------------

    def encode(self, env: Envelope, *, peer: bytes = b"", use_shm: bool = False) -> list[Any]:
        """Frames for ``env``; tensors in ``env.payload`` become descriptors and frames.

        Shared-memory slots lent by this call are listed in ``last_slots``; the caller releases
        them if the frames are never sent.

        Raises:
            TypeError: for a value that cannot travel (a GPU tensor, an object array, ...).
        """
        frames: list[Any] = [b""]
        self._frames = frames
        self._descs = env.tensors = []
        self._peer = peer
        self._use_shm = use_shm and self.shm_pool is not None
        self.last_slots = []
        try:
            frames[0] = self._encoder.encode(env)
        except BaseException:
            self._release_local()
            raise
        return frames

    def encode_message(self, seq: int, topic: str, incarnation: int, payload: Any) -> list[Any]:
        """Frames of a MESSAGE envelope, the same bytes as ``encode`` writes for
        ``Envelope(PROTOCOL_VERSION, Kind.MESSAGE, seq, topic, incarnation=incarnation,
        payload=payload)``, without building the Struct (a stream sends one per message).
        Tensors become descriptors and frames, never shared memory.

        Raises:
            TypeError: as ``encode``.
        """
        frames: list[Any] = [b""]
        descs: list[TensorDesc] = []
        self._frames = frames
        self._descs = descs
        self._use_shm = False
        self.last_slots = []
        # A tuple encodes as the envelope's array; ``descs`` is written after the payload, so
        # the hook has filled it by then.
        frames[0] = self._encoder.encode(
            (PROTOCOL_VERSION, _MESSAGE, seq, topic, 0.0, 0, incarnation, "", payload, descs)
        )
        return frames

    def _release_local(self) -> None:
        if self.shm_pool is not None:
            for slot in self.last_slots:
                self.shm_pool.release(slot)
        self.last_slots = []

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._add_torch(obj)
        if isinstance(obj, np.ndarray):
            return self._add_numpy(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(
            f"cannot encode a value of type {type(obj).__qualname__}: payloads hold msgspec "
            f"Structs, builtins, torch CPU tensors and numpy arrays"
        )

    def _add_torch(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        torch = _torch()
        if t.device.type != "cpu":
            raise TypeError(
                f"cannot encode a tensor on {t.device}: the transport carries CPU tensors; "
                f"call .cpu() first, or move it with the hardware plugin's broadcast"
            )
        if t.layout != torch.strided:
            raise TypeError(f"cannot encode a {t.layout} tensor; call .to_dense() first")
        name = str(t.dtype).removeprefix("torch.")
        if name not in torch_dtypes():
            raise TypeError(f"cannot encode a tensor of dtype {t.dtype}")
        t = t.detach().resolve_conj().resolve_neg()
        shape = list(t.shape)
        nbytes = t.numel() * t.element_size()
        index = len(self._descs)
        slot = self._shm_slot(nbytes)
        if slot is not None:
            dst = torch.from_numpy(slot.array[:nbytes])
            try:
                if t.is_contiguous():  # as bytes: bit-packed dtypes have no copy kernel
                    dst.copy_(t.reshape(-1).view(torch.uint8))
                else:
                    dst.view(t.dtype).view(t.shape).copy_(t)
            except RuntimeError as exc:  # encode() gives the slot back
                raise TypeError(f"cannot encode a tensor of dtype {t.dtype}: {exc}") from exc
            self._descs.append(
                TensorDesc(
                    "torch", name, shape, nbytes, Where.SHM, segment=slot.segment, slot=slot.id
                )
            )
            return _ext_for(index)
        try:
            flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        except RuntimeError as exc:
            raise TypeError(f"cannot encode a tensor of dtype {t.dtype}: {exc}") from exc
        return self._add_bytes("torch", name, shape, nbytes, flat, index)

    def _add_numpy(self, a: np.ndarray) -> msgspec.msgpack.Ext:
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(
                f"cannot encode a numpy array of dtype {a.dtype}: object and structured arrays "
                f"do not travel; use a plain numeric dtype"
            )
        shape = list(a.shape)
        nbytes = a.nbytes
        index = len(self._descs)
        slot = self._shm_slot(nbytes)
        if slot is not None:
            np.copyto(slot.array[:nbytes].view(a.dtype).reshape(a.shape), a)
            self._descs.append(
                TensorDesc(
                    "numpy",
                    a.dtype.str,
                    shape,
                    nbytes,
                    Where.SHM,
                    segment=slot.segment,
                    slot=slot.id,
                )
            )
            return _ext_for(index)
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return self._add_bytes("numpy", a.dtype.str, shape, nbytes, flat, index)

    def _shm_slot(self, nbytes: int) -> Any:
        if not self._use_shm or nbytes < self.shm_threshold or self.shm_pool is None:
            return None
        slot = self.shm_pool.acquire(nbytes, self._peer)
        if slot is not None:
            self.last_slots.append(slot.id)
        return slot

    def _add_bytes(
        self,
        lib: str,
        dtype: str,
        shape: list[int],
        nbytes: int,
        flat: np.ndarray,
        index: int,
    ) -> msgspec.msgpack.Ext:
        if nbytes <= self.inline_threshold:
            self._descs.append(
                TensorDesc(lib, dtype, shape, nbytes, Where.INLINE, data=flat.tobytes())
            )
        else:
            self._frames.append(flat)
            self._descs.append(
                TensorDesc(lib, dtype, shape, nbytes, Where.FRAME, frame=len(self._frames) - 1)
            )
        return _ext_for(index)

    # -- decoding -------------------------------------------------------------------------

    def decode_envelope(self, frames: Frames) -> RawEnvelope:
        """Read frame 0 of a received message, leaving the payload undecoded.

        Raises:
            MessageTooLargeError: the frames together exceed ``max_message_bytes``.
            DecodeError: frame 0 is not a valid envelope.
            ProtocolVersionError: the envelope carries another protocol version.
            UnknownKindError: the kind is not one of ``Kind``.
        """
        if not frames:
            raise DecodeError("empty message: expected at least the envelope frame")
        size = 0
        for frame in frames:
            size += len(frame)
        if size > self.max_message_bytes:
            raise MessageTooLargeError(
                f"message of {size} bytes exceeds the limit of {self.max_message_bytes} bytes; "
                f"send less per message or raise max_message_bytes on the receiver"
            )
        try:
            env = self._raw_decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            # Positions 0 and 1 (version, kind) mean the same in every version: another
            # version's envelope is refused as such, whatever its layout.
            theirs = self._version_of(frames[0])
            if theirs is not None and theirs != PROTOCOL_VERSION:
                raise ProtocolVersionError(PROTOCOL_VERSION, theirs) from exc
            raise DecodeError(f"frame 0 is not a valid envelope: {exc}") from exc
        if env.version != PROTOCOL_VERSION:
            raise ProtocolVersionError(PROTOCOL_VERSION, env.version)
        if env.kind not in _KINDS:
            raise UnknownKindError(
                f"unknown envelope kind {env.kind}; known kinds are "
                + ", ".join(f"{k.value} ({k.name})" for k in Kind)
            )
        return env

    def _head(self, frame: Any) -> tuple[int | None, int | None]:
        """(version, id) of a frame that failed validation, each None when it is not an int.

        Only the first three positions are read; the rest is skipped without being built, so a
        frame that is large or deep costs no memory here.
        """
        try:
            head = self._head_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None, None
        return self._raw_int(head.version), self._raw_int(head.id)

    def _raw_int(self, raw: msgspec.Raw) -> int | None:
        try:
            value: int = self._int_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return value

    def _version_of(self, frame: Any) -> int | None:
        return self._head(frame)[0]

    def salvage_id(self, frames: Frames) -> int:
        """The id of an envelope that failed validation, when it can still be read (else 0)."""
        if not frames:
            return 0
        request_id = self._head(frames[0])[1]
        return request_id if request_id is not None and 0 <= request_id < 1 << 64 else 0

    def decode_payload(
        self,
        env: RawEnvelope,
        frames: Frames,
        type_: Any = Any,
        on_release: Callable[[int], None] | None = None,
        *,
        allow_shm: bool = True,
    ) -> Any:
        """Decode ``env.payload`` as ``type_``, rebuilding its tensors from ``frames``.

        ``on_release(slot)`` is called (from whichever thread drops the last reference) once no
        tensor views a shared-memory slot any longer. ``allow_shm=False`` refuses shared-memory
        descriptors: the receiver passes it for a peer that has not handshaken from this host.

        Raises:
            DecodeError: the payload does not decode as ``type_``.
            TensorDescriptorError: a descriptor disagrees with the bytes it points to, names a
                library this process has not imported, or uses shared memory that is refused.
                ``reason`` says which, for the receiver's counters.
        """
        decoder = self._decoders.get(type_)
        if decoder is None:
            decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=dec_hook)
            self._decoders[type_] = decoder
        if env.tensors:
            self._check_descs(env, frames, allow_shm)
        self._in_env, self._in_frames, self._on_release = env, frames, on_release
        try:
            return decoder.decode(env.payload)
        except TensorDescriptorError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, TensorDescriptorError) else None
            if cause is not None:
                raise cause from exc
            raise DecodeError(f"payload of {env.method or Kind(env.kind).name}: {exc}") from exc
        finally:
            self._in_env, self._in_frames, self._on_release = None, (), None

    def _check_descs(self, env: RawEnvelope, frames: Frames, allow_shm: bool) -> None:
        for i, d in enumerate(env.tensors):
            if len(d.shape) > MAX_DIMS:
                raise TensorDescriptorError(
                    f"tensor {i} ({d.lib} {d.dtype}): shape has {len(d.shape)} dimensions, over "
                    f"the limit of {MAX_DIMS}"
                )
            where = f"tensor {i} ({d.lib} {d.dtype} {d.shape})"
            if any(s < 0 for s in d.shape):
                raise TensorDescriptorError(f"{where}: negative dimension in shape")
            if any(s > MAX_DIM for s in d.shape):
                raise TensorDescriptorError(f"{where}: a dimension is over the limit of 2**63 - 1")
            itemsize = _itemsize(d, where)
            expected = _shape_nbytes(d.shape, itemsize)
            if expected != d.nbytes:
                raise TensorDescriptorError(
                    f"{where}: nbytes is {d.nbytes}, but shape and dtype need {expected}"
                )
            if d.where == Where.INLINE:
                actual = len(d.data)
            elif d.where == Where.FRAME:
                if not 1 <= d.frame < len(frames):
                    raise TensorDescriptorError(
                        f"{where}: points at frame {d.frame}, but the message has frames "
                        f"1..{len(frames) - 1}"
                    )
                actual = len(frames[d.frame])
            elif d.where == Where.SHM:
                if self.shm_reader is None:
                    raise TensorDescriptorError(
                        f"{where}: sent through shared memory, which this receiver refused",
                        reason="shm_refused",
                    )
                if not allow_shm:
                    raise TensorDescriptorError(
                        f"{where}: sent through shared memory by a peer that has not handshaken "
                        f"from this host; send HANDSHAKE (with shm and this host's id) first, "
                        f"or send the bytes inline or as a frame",
                        reason="shm_refused",
                    )
                actual = d.nbytes
            else:
                raise TensorDescriptorError(f"{where}: unknown location {d.where}")
            if actual != expected:
                raise TensorDescriptorError(
                    f"{where}: descriptor needs {expected} bytes, the message carries {actual}"
                )

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        env = self._in_env
        if code != TENSOR_EXT or env is None:
            raise TensorDescriptorError(f"unknown extension type {code} in payload")
        if len(data) != 4:
            raise TensorDescriptorError(
                f"a tensor reference (extension type {TENSOR_EXT}) holds {len(data)} bytes; "
                f"it must hold a 4-byte little-endian index"
            )
        index = int.from_bytes(data, "little")
        if index >= len(env.tensors):
            raise TensorDescriptorError(
                f"payload refers to tensor {index}, but the envelope describes {len(env.tensors)}"
            )
        desc = env.tensors[index]
        try:
            return self._build(desc)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise TensorDescriptorError(
                f"tensor {index} ({desc.lib} {desc.dtype} {desc.shape}) cannot be rebuilt: {exc}"
            ) from exc

    def _build(self, d: TensorDesc) -> Any:
        buf: Any
        if d.where == Where.INLINE:
            buf = bytearray(d.data)
        elif d.where == Where.FRAME:
            frame = self._in_frames[d.frame]
            buf = frame.buffer if hasattr(frame, "buffer") else bytearray(frame)
        else:
            assert self.shm_reader is not None
            try:
                buf = self.shm_reader.view(d.segment, d.offset, d.nbytes)
            except (OSError, ValueError) as exc:
                raise TensorDescriptorError(f"shared-memory tensor: {exc}") from exc
            if self._on_release is not None:
                weakref.finalize(buf, self._on_release, d.slot)
        if d.lib == "torch":
            torch = sys.modules["torch"]  # _itemsize checked that it is imported
            dtype = torch_dtypes()[d.dtype]
            if d.nbytes == 0:
                return torch.empty(d.shape, dtype=dtype)
            flat = (
                torch.from_numpy(buf)
                if isinstance(buf, np.ndarray)
                else torch.frombuffer(buf, dtype=torch.uint8)
            )
            return flat.view(dtype).view(d.shape)
        arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
        return arr.view(np.dtype(d.dtype)).reshape(d.shape)


def _itemsize(d: TensorDesc, where: str) -> int:
    if d.lib == "torch":
        if "torch" not in sys.modules:
            raise TensorDescriptorError(
                f"{where}: library 'torch' is not imported in this process, and a receiver "
                f"does not import a library because a peer asked; send a numpy array, or "
                f"import torch in the receiving process before it serves",
                reason="library_not_imported",
            )
        dtype = torch_dtypes().get(d.dtype)
        if dtype is None:
            raise TensorDescriptorError(f"{where}: unknown torch dtype {d.dtype!r}")
        return dtype.itemsize
    if d.lib == "numpy":
        try:
            np_dtype = np.dtype(d.dtype)
        except (TypeError, ValueError) as exc:
            raise TensorDescriptorError(f"{where}: unknown numpy dtype {d.dtype!r}") from exc
        if (
            np_dtype.hasobject
            or np_dtype.fields is not None
            or np_dtype.subdtype is not None
            or np_dtype.itemsize == 0
        ):
            raise TensorDescriptorError(f"{where}: numpy dtype {d.dtype!r} cannot travel")
        return np_dtype.itemsize
    raise TensorDescriptorError(f"{where}: unknown library {d.lib!r}; expected torch or numpy")


def dec_hook(type_: Any, obj: Any) -> Any:
    """The decoders' hook for a custom type: only an instance of it passes (no conversion)."""
    if isinstance(obj, type_):
        return obj
    raise TypeError(f"expected {type_.__qualname__}, got {type(obj).__qualname__}")

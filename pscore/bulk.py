"""The shards' bulk data path on raw TCP (the data port): its frames, and the connection that carries them.

Big pulls and pushes skip gRPC: the tensor bytes go from the sender's arrays to
the socket and from the socket into the receiver's arrays (one kernel copy
each way, no HTTP/2 framing, no protobuf copies). gRPC stays the control plane:
the ``ParameterServer.DataPort`` call (token-guarded like every call) hands out
the port and a one-time nonce (``pscore.transport``).

A frame (the full description is in ``ps.proto``, above ``ShardDataPortRequest``)
is a 16-byte prefix (kind, head length, payload length), a head (a ``ps.proto``
message) and a payload: the raw bytes of the head's ``TensorChunk`` s, each a
whole tensor whose ``data`` is left empty, in order. A BATCH frame carries
several requests as ``entries``, a BATCHED frame answers to some of them.

>>> import numpy as np
>>> head = ps_pb2.PushRequest(worker_id="w0", grads=[describe("w", np.zeros((2, 3), np.float32))])
>>> tensor_layout(head.grads)
[('w', dtype('float32'), (2, 3), 24)]
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from pscore import codec
from pscore.errors import InvalidArgumentError, UnavailableError
from pscore.transport import Buffer, Conn, FrameTransport, Into
from psproto.v1 import ps_pb2

MAGIC: Final[bytes] = b"PSDATA1\n"

PUSH: Final[int] = 1
PULL: Final[int] = 2
PUSHED: Final[int] = 3
PULLED: Final[int] = 4
ERROR: Final[int] = 5
LOOKUP: Final[int] = 6
LOOKED_UP: Final[int] = 7
BATCH: Final[int] = 8  # requests that travel together (``entries``)
BATCHED: Final[int] = 9  # answers to some of a BATCH's requests
HEADS: Final[dict[int, type]] = {
    PUSH: ps_pb2.PushRequest,
    PULL: ps_pb2.PullRequest,
    PUSHED: ps_pb2.PushResponse,
    PULLED: ps_pb2.PullResponse,
    ERROR: ps_pb2.DataPortError,
    LOOKUP: ps_pb2.LookupRequest,
    LOOKED_UP: ps_pb2.LookupResponse,
    BATCH: ps_pb2.DataPortBatch,
    BATCHED: ps_pb2.DataPortBatch,
}
REQUESTS: Final[dict[int, str]] = {PUSH: "Push", PULL: "Pull", LOOKUP: "Lookup"}  # kind -> the RPC it is
TENSOR_FIELDS: Final[dict[int, str]] = {
    PUSH: "grads",
    PUSHED: "values",
    PULLED: "values",
    LOOKED_UP: "values",
}

_PREFIX: Final = struct.Struct("<BxxxIQ")  # kind, head bytes, payload bytes
PREFIX_BYTES: Final[int] = _PREFIX.size
MAX_HEAD_BYTES: Final[int] = 64 << 20  # a head holds names, shapes and versions only
_SMALL_FRAME: Final[int] = 64 << 10  # a frame up to this is sent in one write
_ENTRY: Final = struct.Struct("<IBxxxIQ")  # a BATCH(ED) entry: index, kind, head bytes, payload bytes
ANSWERS: Final[frozenset[int]] = frozenset({PUSHED, PULLED, ERROR, LOOKED_UP})  # the kinds of a BATCHED entry


@dataclass(slots=True)
class Frame:
    """A frame's kind and its head (a message of ``HEADS[kind]``; a frame to send: or its encoding, bytes).
    Not frozen: a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (0.39 against
    0.15 us), and a request makes two frames each side."""

    kind: int
    head: Any

    def tensors(self) -> Sequence[ps_pb2.TensorChunk]:
        """The head's tensors (described, their bytes are the payload); none for a kind without."""
        field = TENSOR_FIELDS.get(self.kind)
        return getattr(self.head, field) if field is not None else ()


def entries(items: Iterable[tuple[int, Frame, Sequence[Buffer]]]) -> list[Buffer]:
    """The payload of a BATCH or BATCHED frame: each ``(index, frame, its payload)`` as an entry
    (``ps.proto``, above ``ShardDataPortRequest``), not copied.

    >>> entry = entries([(3, Frame(PULL, ps_pb2.PullRequest(names=["w"])), ())])
    >>> [(i, f.kind, list(f.head.names), bytes(p)) for i, f, p in read_entries(b"".join(entry), 1, REQUESTS)]
    [(3, 2, ['w'], b'')]
    """
    out: list[Buffer] = []
    pack = _ENTRY.pack
    for index, frame, payload in items:
        head = frame.head if type(frame.head) is bytes else frame.head.SerializeToString()
        size = 0
        for part in payload:
            size += len(part)
        out.append(pack(index, frame.kind, len(head), size))
        out.append(head)
        out += payload
    return out


def read_entries(
    payload: Buffer, count: int, kinds: Iterable[int]
) -> list[tuple[int, Frame | codec.CodecError, memoryview]]:
    """The ``count`` entries of a BATCH or BATCHED frame's payload: ``(index, frame, its payload)`` each (a
    view of ``payload``), in order; an entry whose kind is not one of ``kinds`` or whose head does not
    parse is a ``CodecError`` in place of its frame (its neighbours are read on).

    Raises:
        CodecError: the entries do not fill the payload exactly (the frame is not one).
    """
    view = memoryview(payload)
    end = len(view)
    out: list[tuple[int, Frame | codec.CodecError, memoryview]] = []
    unpack = _ENTRY.unpack_from
    at = 0
    for _ in range(count):
        if at + _ENTRY.size > end:
            raise codec.CodecError(f"a batch of {count} entries ends after {len(out)}")
        index, kind, head_len, size = unpack(view, at)
        start = at + _ENTRY.size
        at = start + head_len + size
        if at > end:
            raise codec.CodecError(f"a batch's entry {index} runs past the frame's payload")
        message = HEADS.get(kind) if kind in kinds else None
        item: Frame | codec.CodecError
        if message is None:
            item = codec.CodecError(f"a batch's entry cannot be a frame of kind {kind}")
        else:
            try:
                item = Frame(kind, message.FromString(bytes(view[start : start + head_len])))
            except Exception as err:  # protobuf's DecodeError
                item = codec.CodecError(f"malformed {message.__name__} head: {err}")
        out.append((index, item, view[start + head_len : at]))
    if at != end:
        raise codec.CodecError(f"{end - at} bytes after a batch's {count} entries")
    return out


class _Refused(Exception):
    """``into`` raised ``err`` (carried through ``recv``'s own error handling unchanged)."""

    def __init__(self, err: BaseException) -> None:
        super().__init__(str(err))
        self.err = err


class Closed(UnavailableError):
    """The peer closed the connection between two frames (not an error for a server)."""


def describe(name: str, value: np.ndarray) -> ps_pb2.TensorChunk:
    """The ``TensorChunk`` announcing the whole of ``value`` (a wire array) in a head, without its bytes."""
    return ps_pb2.TensorChunk(name=name, dtype=codec.wire_dtype(value.dtype), shape=value.shape)


class Descriptions(dict[tuple[str, np.dtype, tuple[int, ...]], bytes]):
    """``describe`` 's descriptions as encoded entries of the repeated ``TensorChunk`` field ``field`` of
    ``message``, by (name, dtype, shape), made on first use (``d[name, dtype, shape]``) and kept for the
    next heads that announce the same tensor. A head to send is then the encoding of its other fields
    followed by these entries, as bytes (a ``Frame`` 's head may be; a message's encoding may come in
    parts, a repeated field's entries in order): neither a ``TensorChunk`` nor a copy of one per head
    (about 1 us a tensor). At most ``limit`` are kept (a table's rows vary in shape from push to push):
    then they start over.

    >>> d = Descriptions(ps_pb2.PushRequest, "grads")
    >>> encoded = ps_pb2.PushRequest(seq=7).SerializeToString() + d["w", np.dtype(np.float32), (2, 3)]
    >>> head = ps_pb2.PushRequest.FromString(encoded)
    >>> head.seq, head.grads[0].name, list(head.grads[0].shape)
    (7, 'w', [2, 3])
    """

    def __init__(self, message: type, field: str, limit: int = 1024) -> None:
        super().__init__()
        self.limit = limit
        self._message = message
        self._field = field

    def __missing__(self, key: tuple[str, np.dtype, tuple[int, ...]]) -> bytes:
        if len(self) >= self.limit:
            self.clear()
        name, dtype, shape = key
        chunk = ps_pb2.TensorChunk(
            name=name, dtype=codec.DTYPE_WIRES.get(dtype) or codec.wire_dtype(dtype), shape=shape
        )
        entry = self[key] = self._message(**{self._field: [chunk]}).SerializeToString()
        return entry


# An announced tensor: its name, dtype, shape and byte count (``tensor_layout``).
Layout = list[tuple[str, np.dtype, tuple[int, ...], int]]


def tensor_layout(chunks: Iterable[ps_pb2.TensorChunk]) -> Layout:
    """Each announced tensor's name, dtype, shape and byte count (from its dtype and shape), read from
    the head once: its payload's place and the array over it need no second look at the message.

    Raises:
        CodecError: an unknown dtype, a negative dimension, or a chunk that is not a whole
            tensor (an offset, or data in the head).
    """
    out: Layout = []
    dtypes = codec.WIRE_DTYPES
    for chunk in chunks:  # codec.numpy_dtype and codec.chunk_shape, inline: no call per tensor
        name = chunk.name
        dtype = dtypes.get(chunk.dtype)
        if dtype is None:
            raise codec.CodecError(f"tensor {name!r}: unknown wire dtype {chunk.dtype}")
        shape = tuple(chunk.shape)
        if shape and min(shape) < 0:
            raise codec.CodecError(f"tensor {name!r} has a negative dimension in shape {shape}")
        if chunk.offset or chunk.data:
            raise codec.CodecError(f"tensor {name!r}: on the data port a tensor travels whole")
        out.append((name, dtype, shape, math.prod(shape) * dtype.itemsize))
    return out


def payload_of(values: Iterable[np.ndarray]) -> list[memoryview]:
    """The payload buffers of wire arrays (C-contiguous, little-endian), not copied."""
    return [memoryview(v.reshape(-1)).cast("B") for v in values]


class BulkConnection(FrameTransport[Frame]):
    """One data-port connection: frames out and in (see the module doc).

    Args:
        conn: the connection (from ``transport.dial`` or a ``transport.DataPort``).
        peer: who is at the other end (for messages).
    """

    def __init__(self, conn: Conn, peer: str) -> None:
        self._conn: Conn | None = conn
        self.open = True  # whether the connection is usable (not reset)
        self.peer = peer
        self._prefix = bytearray(PREFIX_BYTES)
        self._buf = bytearray()  # payloads nobody gave a place for

    def limit_unsent(self, nbytes: int) -> None:
        """See ``transport.Conn.limit_unsent`` (nothing on a reset connection)."""
        if self._conn is not None:
            self._conn.limit_unsent(nbytes)

    def delivery_rate(self) -> int:
        """See ``transport.Conn.delivery_rate`` (0 on a reset connection)."""
        return self._conn.delivery_rate() if self._conn is not None else 0

    def delivery_wait(self, nbytes: int) -> float:
        """See ``transport.Conn.delivery_wait`` (0 on a reset connection)."""
        return self._conn.delivery_wait(nbytes) if self._conn is not None else 0.0

    async def delivered(self, nbytes: int, deadline: float) -> None:
        """See ``transport.Conn.delivered`` (at once on a reset connection)."""
        if self._conn is not None:
            await self._conn.delivered(nbytes, deadline)

    def _live(self) -> Conn:
        if self._conn is None:
            raise UnavailableError(f"the data connection to {self.peer} is closed", address=self.peer)
        return self._conn

    async def send(self, header: Frame, payload: Sequence[Buffer] = ()) -> None:
        conn = self._conn
        if conn is None:
            conn = self._live()  # raises
        head = header.head if type(header.head) is bytes else header.head.SerializeToString()
        size = sum(map(len, payload))
        first = _PREFIX.pack(header.kind, len(head), size) + head
        try:
            if size <= _SMALL_FRAME:
                await conn.sendall(b"".join((first, *payload)))
            else:
                await conn.send_views((first, *payload))
            # A request or an answer: the peer sends nothing on this connection before it has it (a BATCH's
            # answers may come in several frames: the first read waits, the next ones try at once).
            conn.answer_due = True
        except OSError as err:
            self.reset()
            raise UnavailableError(
                f"the data connection to {self.peer} broke: {type(err).__name__}: {err}", address=self.peer
            ) from None

    async def recv(self, into: Into[Frame] | None = None) -> tuple[Frame, memoryview | None]:
        """Receives a frame (see ``FrameTransport.recv``).

        Raises:
            Closed: the peer closed the connection before a frame began.
            UnavailableError: the connection broke inside a frame.
            InvalidArgumentError: the bytes are not a frame (the connection is reset).
            Exception: what ``into`` raised (the connection is reset: the payload was not read).
        """
        conn = self._conn
        if conn is None:
            conn = self._live()  # raises
        try:
            try:
                await conn.recv_exactly(memoryview(self._prefix))
            except ConnectionError:
                self.reset()
                raise Closed(f"{self.peer} closed the data connection", address=self.peer) from None
            kind, head_len, size = _PREFIX.unpack(self._prefix)
            message = HEADS.get(kind)
            if message is None or head_len > MAX_HEAD_BYTES:
                raise codec.CodecError(f"not a data-port frame (kind {kind}, head of {head_len} bytes)")
            head = bytearray(head_len)
            await conn.recv_exactly(memoryview(head))
            try:
                frame = Frame(kind, message.FromString(bytes(head)))
            except Exception as err:  # protobuf's DecodeError
                raise codec.CodecError(f"malformed {message.__name__} head: {err}") from None
            try:
                targets = into(frame, size) if into is not None else None
            except BaseException as err:
                raise _Refused(err) from err
            if targets is None:
                if len(self._buf) < size:
                    self._buf = bytearray(size)
                view = memoryview(self._buf)[:size]
                if size:  # a frame without a payload reads nothing more
                    await conn.recv_exactly(view)
                return frame, view
            if sum(map(len, targets)) != size:
                raise codec.CodecError(f"frame announces {size} payload bytes; its head describes others")
            await conn.recv_views(targets)
            return frame, None
        except _Refused as refused:
            self.reset()  # the payload was not read
            raise refused.err from None
        except codec.CodecError as err:
            self.reset()
            raise InvalidArgumentError(f"bad frame from {self.peer}: {err}", address=self.peer) from None
        except OSError as err:
            self.reset()
            raise UnavailableError(
                f"the data connection to {self.peer} broke inside a frame: {type(err).__name__}: {err}",
                address=self.peer,
            ) from None
        except BaseException:
            self.reset()  # cancelled or failed inside a frame: the stream is out of step
            raise

    def reset(self) -> None:
        self.open = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None

"""The base of every wire contract, and the binary wire format.

Every message is a frozen pydantic model that forbids unknown fields and carries
``schema_version``; a producer and a consumer that disagree on the version fail
validation with a clear error instead of misreading each other.

On the bus a message travels as msgpack of its Python-mode dump, in which arrays
are raw bytes (see :mod:`proto.arrays`). REST bodies use the JSON mode of the same
models (arrays as base64).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from proto.arrays import PIECE_BYTES, WIRE_CONTEXT, Pieces, arrays_equal

if TYPE_CHECKING:
    from proto.messages import TaskRef

__all__ = [
    "SCHEMA_VERSION",
    "Contract",
    "Message",
    "decode",
    "derived_id",
    "encode",
    "encode_parts",
    "new_id",
    "unfit_value",
]

SCHEMA_VERSION = 1


def new_id() -> str:
    """A random 128-bit id as 32 hex characters."""
    return uuid.uuid4().hex


def derived_id(*parts: str) -> str:
    """An id that depends only on what a message was made from: a retry after a crash re-publishes
    the same id, and the next consumer's idempotency check catches it."""
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:32]


MSGPACK_INTS = (-(2**63), 2**64)  # the integers a message can carry


def unfit_value(value: Any, max_depth: int) -> Literal["not finite", "too large", "too deep"] | None:
    """What keeps a JSON-like value (a run's inline config, a tool call's arguments) from being stored
    and sent: a number that is not finite (no JSON holds it), an integer msgpack cannot hold, or
    nesting past ``max_depth``; None if nothing does. Iterative, and the depth is checked before
    going deeper, so no input can exhaust the stack."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return "not finite"
        if isinstance(v, int) and not isinstance(v, bool) and not MSGPACK_INTS[0] <= v < MSGPACK_INTS[1]:
            return "too large"
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else ()
        if children and depth == max_depth:
            return "too deep"
        stack += [(c, depth + 1) for c in children]
    return None


class Contract(BaseModel):
    """Frozen, closed, value-compared model (arrays compare by value)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, ser_json_bytes="base64", val_json_bytes="base64"
    )

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(arrays_equal(getattr(self, k), getattr(other, k)) for k in type(self).model_fields)

    __hash__ = None  # type: ignore[assignment]  # arrays are unhashable; equality is by value


class Message(Contract):
    """A top-level message on a stream: versioned and uniquely identified.

    ``message_id`` is the idempotency key: a consumer processes each id once, even
    when the producer retries the publish or the bus redelivers the entry.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    message_id: str = Field(default_factory=new_id, min_length=1, max_length=128)

    def without_bulk(self) -> Message:
        """This message as a dead letter keeps it: without what is large and of no use there (a
        group's routed experts, hundreds of MB with routing replay). Most messages keep it all."""
        return self

    def task_ref(self) -> TaskRef | None:
        """The prompt task this message carries or answers, as a dead letter names it (whose run
        and task it was, without decoding the payload again); None for a message of no task."""
        return None


M = TypeVar("M", bound=BaseModel)


def encode(message: BaseModel) -> bytes:
    """Binary wire form: msgpack of the Python-mode dump (arrays stay raw bytes).

    The same bytes as one ``packb`` of the whole dump, packed a piece at a time and joined. The bus
    encodes in a thread so that its event loop runs meanwhile, which it can only while the thread
    lets go of the interpreter: between the pieces, and in the join, which copies large bytes
    without holding it. So the message is packed down to the items of a field (a group's
    trajectories), and further wherever a large array lies: one is dumped as copies of a MiB at a
    time (:class:`proto.arrays.Pieces`) that the join puts together, where ``tobytes`` then
    ``packb`` copied it whole twice, which held the loop of a keep or a publish of a 200 MB group
    for as long as a copy of a trajectory's 25 MB of routes took."""
    return b"".join(_pieces(message))


def encode_parts(message: BaseModel) -> list[bytes]:
    """:func:`encode`'s bytes as parts, in order, never joined whole: a large array's pieces as
    they are, what lies between them joined up to about ``PIECE_BYTES`` (a container packed
    whole, one holding no large array below the packed depth, is one part, however long). The bus
    writes a large payload from its parts and lets go of them a few at a time
    (:mod:`services.bus.freeing`): one 200 MB bytes object took 14-19 ms to free, all of it
    holding the interpreter."""
    parts: list[bytes] = []
    run: list[bytes] = []  # small pieces since the last part
    held = 0
    for piece in _pieces(message):
        if len(piece) >= PIECE_BYTES // 2:  # an array's piece: a part as it is
            if run:
                parts.append(b"".join(run))
                run, held = [], 0
            parts.append(piece)
            continue
        run.append(piece)
        held += len(piece)
        if held >= PIECE_BYTES:
            parts.append(b"".join(run))
            run, held = [], 0
    if run or not parts:
        parts.append(b"".join(run))
    return parts


def _pieces(message: BaseModel) -> Iterator[bytes]:
    packer = msgpack.Packer(use_bin_type=True, default=_holds_pieces)
    return _packed(packer, message.model_dump(mode="python", context=WIRE_CONTEXT), PACKED_DEPTH)


PACKED_DEPTH = 3  # the message, its fields, the items of a field


class _HoldsPieces(Exception):
    pass


def _holds_pieces(value: Any) -> Any:
    """The packer's hook for a type it cannot pack: Pieces are packed by :func:`_packed`."""
    if type(value) is Pieces:
        raise _HoldsPieces
    if type(value) is int:  # msgpack asks about an integer past 64 bits: packb's error
        raise OverflowError("Integer value out of range")
    raise TypeError(f"can not serialize {type(value).__name__!r} object")


def _packed(packer: msgpack.Packer, value: Any, depth: int) -> Iterator[bytes]:
    # exact types: a subclass (msgpack's ExtType is a tuple) is packed whole, as packb packs it
    if type(value) in (dict, list, tuple) and depth <= 0:
        try:  # whole, unless it holds a large array (the packer starts afresh after a refusal)
            whole = packer.pack(value)
        except _HoldsPieces:
            pass
        else:
            yield whole
            return
    if type(value) is dict:
        yield packer.pack_map_header(len(value))
        for key, item in value.items():
            yield packer.pack(key)
            yield from _packed(packer, item, depth - 1)
    elif type(value) in (list, tuple):
        yield packer.pack_array_header(len(value))
        for item in value:
            yield from _packed(packer, item, depth - 1)
    elif type(value) is Pieces:
        # packb's header for bin past 64 KiB (bin 32), as Pieces always are: 0xc6, the length
        yield b"\xc6" + sum(map(len, value.pieces)).to_bytes(4, "big")
        yield from value.pieces
    else:
        yield packer.pack(value)


def decode(model: type[M], payload: bytes | bytearray | memoryview | Sequence[bytes]) -> M:
    """Inverse of :func:`encode`; raises ``ValueError`` (pydantic's ValidationError included) on bad
    input. ``payload`` is the wire form, or its slices in order (a value read a few MiB at a time).

    Slices are unpacked a piece at a time, as :func:`encode` packs them, straight from the slices:
    joining a 200 MB keep's slices and unpacking the result took 0.17-0.20 s in a thread and
    stalled the caller's event loop for up to 0.04-0.28 s, where the pieces take 0.06-0.09 s and
    the loop runs between them (benchmarks/keeps.py, six runs on a 2-core VM). A large array's
    bytes are taken from the slices a MiB at a time (:func:`_bin`), so no piece holds the loop for
    a copy of a trajectory's routes."""
    if not isinstance(payload, bytes | bytearray | memoryview) and len(payload) == 1:
        payload = payload[0]  # one slice is the whole value
    try:
        if isinstance(payload, bytes | bytearray | memoryview):
            data: Any = msgpack.unpackb(payload, **_UNPACKING)
        else:
            data = _unpacked_slices(payload)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ValueError(f"payload is not valid msgpack: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"payload must be a map, got {type(data).__name__}")
    return model.model_validate(data)


_UNPACKING: dict[str, Any] = {"raw": False, "strict_map_key": True}
_READ_BYTES = 4 << 20  # what the unpacker takes from the slices at a time


def _unpacked_slices(slices: Sequence[bytes]) -> Any:
    reader = _SliceReader(slices)
    unpacker = msgpack.Unpacker(
        reader, **_UNPACKING, read_size=_READ_BYTES, max_buffer_size=max(reader.size, _READ_BYTES)
    )
    data = _unpacked(unpacker, reader, PACKED_DEPTH)
    if unpacker.tell() != reader.size:
        raise ValueError(f"{reader.size - unpacker.tell()} bytes of extra data after the message")
    return data


_MAPS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # fixmap, map16, map32: the first byte
_ARRAYS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))  # fixarray, array16, array32
_BIN32 = 0xC6  # msgpack's header for bin past 64 KiB, as every large array's bytes are


def _unpacked(unpacker: msgpack.Unpacker, reader: _SliceReader, depth: int) -> Any:
    # the next value's first byte says whether it is a map or an array to go into, or a leaf.
    # Containers are gone into down to PACKED_DEPTH, as encode packs them; maps (a model's fields,
    # an array's dtype, shape and data) further, so that a large array's bytes are found and read
    # in pieces wherever they lie, down to a bound: nesting is the sender's to choose
    kind = reader.byte_at(unpacker.tell())
    if kind in _MAPS and depth > -PACKED_DEPTH:
        out = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if type(key) not in (str, bytes):  # as unpackb's strict_map_key
                raise ValueError(f"{type(key).__name__} is not allowed for map key")
            out[key] = _unpacked(unpacker, reader, depth - 1)
        return out
    if kind in _ARRAYS and depth > 0:
        return [_unpacked(unpacker, reader, depth - 1) for _ in range(unpacker.read_array_header())]
    if kind == _BIN32:
        return _bin(unpacker, reader)
    return unpacker.unpack()


def _bin(unpacker: msgpack.Unpacker, reader: _SliceReader) -> bytes:
    """A bin value; past ``PIECE_BYTES``, its bytes taken a MiB or a whole slice at a time and joined.

    The unpacker gathers a value whole in a buffer of its own before it makes it a bytes object,
    each a copy of all of it that holds the interpreter: a trajectory's 25 MB of routes held the
    loop of the thread's caller for 17-129 ms. A MiB copy holds it for a fraction of a ms, a whole
    slice is not copied, and the join lets go of it (CPython joins bytes past a MiB without
    holding it): the one copy of the routes left is made while the loop runs."""
    at = unpacker.tell()
    if reader.size - at < 5:
        return unpacker.unpack()  # cut short: the unpacker says so
    size = int.from_bytes(bytes(reader.byte_at(at + i) or 0 for i in range(1, 5)), "big")
    if size <= PIECE_BYTES:
        return unpacker.unpack()
    if size > reader.size - at - 5:
        raise ValueError(f"a bin of {size} bytes runs past the payload's end")
    header = 0
    while header < 5:  # the reader gives at most the rest of a slice: a header may span several
        taken = len(unpacker.read_bytes(5 - header))
        if not taken:
            raise ValueError(f"a bin's header ends after {header} bytes")
        header += taken
    pieces, got = [], 0
    while got < size:
        # what the unpacker holds is copied out a MiB at a time; past it, a slice the reader is at
        # the start of comes whole, not copied, when all of it belongs to the bin
        held, whole = reader.read_to - unpacker.tell(), reader.whole_slice_ahead()
        n = min(held, PIECE_BYTES) if held else whole if 0 < whole <= size - got else PIECE_BYTES
        piece = unpacker.read_bytes(min(n, size - got))
        if not piece:  # the reader ran dry before its size said it would
            raise ValueError(f"a bin of {size} bytes ends after {got}")
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


class _SliceReader:
    """A payload's slices read as one file, without joining them."""

    def __init__(self, slices: Sequence[bytes]) -> None:
        self._slices, self._at = list(slices), 0  # _at: the offset read to
        self._starts = [0, *itertools.accumulate(map(len, self._slices))]
        self.size = self._starts[-1]

    def _slice(self, offset: int) -> tuple[bytes, int]:
        """The slice holding ``offset`` (< size), and the offset within it."""
        i = bisect.bisect_right(self._starts, offset) - 1  # past empty slices, which share a start
        return self._slices[i], offset - self._starts[i]

    @property
    def read_to(self) -> int:
        """The offset read to."""
        return self._at

    def whole_slice_ahead(self) -> int:
        """The length of the slice that starts where the reading is; 0 when it is inside one."""
        if self._at >= self.size:
            return 0
        piece, at = self._slice(self._at)
        return len(piece) if at == 0 else 0

    def byte_at(self, offset: int) -> int | None:
        """The payload's byte at ``offset``; None past its end."""
        if offset >= self.size:
            return None
        piece, at = self._slice(offset)
        return piece[at]

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (the rest of a slice at most; a whole slice is not copied)."""
        if self._at >= self.size:
            return b""
        piece, at = self._slice(self._at)
        end = len(piece) if n < 0 else min(len(piece), at + n)
        self._at += end - at
        return piece if (at, end) == (0, len(piece)) else piece[at:end]

"""Decoding a value read in slices (a keep, a claimed stream entry): unpacked a piece at a time
straight from its slices, large arrays a MiB or a slice at a time, as unpackb unpacks them joined."""

from __future__ import annotations

import itertools

import msgpack
import numpy as np
import pytest

from proto import TrajectoryGroup, decode, encode
from proto import examples as ex
from proto.arrays import PIECE_BYTES
from proto.base import encode_parts
from tests.test_proto import MESSAGES


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_slices_are_unpacked_in_pieces_as_unpackb_would_unpack_them_joined(message, monkeypatch):
    """A value read in slices (a keep) is unpacked a piece at a time straight from its slices, not
    joined (joining and unpacking a 200 MB keep took 0.17-0.20 s, the pieces 0.06-0.09): the same
    message, whatever the slices' sizes, empty ones included."""
    import proto.base as base

    wire = encode(message)
    rng = np.random.default_rng(len(wire))
    for most in (1, 7, 4096):
        cuts = np.cumsum(rng.integers(0, most + 1, size=len(wire)))
        cuts = [0, *cuts[cuts < len(wire)].tolist(), len(wire)]
        slices = [wire[a:b] for a, b in itertools.pairwise(cuts)]
        assert decode(type(message), slices) == message
    if isinstance(message, TrajectoryGroup):  # no piece holds more than one trajectory

        class Measured(msgpack.Unpacker):
            def unpack(self):
                start = self.tell()
                value = super().unpack()
                pieces.append(self.tell() - start)
                return value

        pieces: list[int] = []
        monkeypatch.setattr(base.msgpack, "Unpacker", Measured)
        assert decode(TrajectoryGroup, [wire[:100], wire[100:]]) == message
        one = max(len(msgpack.packb(t.model_dump(), use_bin_type=True)) for t in message.trajectories)
        assert sum(pieces) < len(wire) and max(pieces) < one


def test_unpacking_in_pieces_keeps_every_value_unpackb_gives_and_every_refusal():
    import proto.base as base

    value = {"ext": msgpack.ExtType(5, b"xy"), "a": [[1, {"b": b"z"}], "s", None], "m": {"n": {"o": [2.5]}}}
    wire = msgpack.packb(value, use_bin_type=True)
    unpacked = base._unpacked_slices([wire[:3], b"", wire[3:]])
    assert unpacked == msgpack.unpackb(wire, raw=False, strict_map_key=True) and unpacked["ext"].code == 5
    group = ex.example_group(1)
    good = encode(group)

    def halves(wire: bytes) -> list[bytes]:
        return [wire[: len(wire) // 2], wire[len(wire) // 2 :]]

    with pytest.raises(ValueError, match="not valid msgpack"):
        decode(TrajectoryGroup, halves(good[:-1]))  # cut short
    with pytest.raises(ValueError, match="extra data"):
        decode(TrajectoryGroup, [good, b"\x01"])
    with pytest.raises(ValueError, match="must be a map"):
        decode(TrajectoryGroup, halves(msgpack.packb([1, 2])))
    with pytest.raises(ValueError, match="not allowed for map key"):
        decode(TrajectoryGroup, halves(msgpack.packb({1: 2})))
    with pytest.raises(ValueError, match="not allowed for map key"):  # deeper, unpacked whole
        decode(TrajectoryGroup, halves(msgpack.packb({"a": [{"b": {3: 4}}]})))
    assert decode(TrajectoryGroup, [good]) == group == decode(TrajectoryGroup, halves(good))


def test_every_msgpack_kind_comes_back_from_slices_as_unpackb_gives_it(monkeypatch):
    """Which values to go into is read from the next value's first byte: every kind of header at
    the depths unpacked in pieces (fix, 16- and 32-bit maps and arrays; each kind of leaf), with
    the C unpacker and msgpack's pure-Python one, from slices of one byte; and a header that
    claims four billion entries fails as soon as the data ends."""
    from msgpack import fallback

    import proto.base as base

    ints = [0, -1, 200, 60_000, 2**31, 2**40, -100, -30_000, -(2**31), -(2**40)]
    texts = ["s", "x" * 40, "x" * 300, "y" * 70_000, b"", b"b" * 300, b"c" * 70_000]
    exts = [msgpack.ExtType(i, b"e" * n) for i, n in enumerate((1, 2, 3, 4, 8, 16, 300, 70_000))]
    leaves = [None, True, False, 1.5, *ints, *texts, *exts, [], {}]  # 31
    big = {f"k{i}": leaf for i, leaf in enumerate(leaves)}  # a map16
    value = {"fields": big, "items": [big, leaves, list(range(20))], "deep": {"a": {"b": {"c": leaves}}}}
    wide = {"m": {str(i): i for i in range(65_536)}, "a": list(range(65_536))}  # a map32, an array32
    cases = [
        # arrays gone into down to depth 3, maps further: the 3 top keys; fields' 31 keys and 29
        # leaves ([] and {} are gone into at that depth); items' map (31 keys, 30 leaves: {} is gone
        # into), list (30: {} again) and range (20, an array16); deep's 3 keys and a leaf
        (msgpack.packb(value, use_bin_type=True), 1, 3 + 60 + 61 + 30 + 20 + 4),
        (msgpack.packb(value, use_bin_type=True, use_single_float=True), 1, 3 + 60 + 61 + 30 + 20 + 4),
        (msgpack.packb(wide, use_bin_type=True), 1000, 2 + 2 * 65_536 + 65_536),
    ]
    pieces: list[int] = []
    for unpacker in (msgpack.Unpacker, fallback.Unpacker):

        class Counted(unpacker):
            def unpack(self):
                pieces.append(1)
                return super().unpack()

        monkeypatch.setattr(base.msgpack, "Unpacker", Counted)
        for wire, step, unpacked in cases:
            expected = msgpack.unpackb(wire, raw=False, strict_map_key=True)
            pieces.clear()
            assert base._unpacked_slices([wire[i : i + step] for i in range(0, len(wire), step)]) == expected
            assert len(pieces) == unpacked
            assert base._unpacked_slices([b"", wire[:5], b"", wire[5:], b""]) == expected
    monkeypatch.undo()  # msgpack's own unpacker again
    with pytest.raises(ValueError, match="not valid msgpack"):  # a map32 of 2**32 - 1 entries
        decode(TrajectoryGroup, [b"\xdf\xff\xff\xff\xff", b"\xa1k\x01"])


@pytest.mark.parametrize("scored", [False, True], ids=["group", "scored"])
def test_a_large_array_is_read_from_slices_a_mib_at_a_time_wherever_it_lies(scored, monkeypatch):
    """The decoding's side of the test above: a trajectory's routes (2.3 MB each) are taken from the
    slices as bytes of a MiB at most, or as whole slices that lie inside them, not copied, which
    only the join puts together, in a group's trajectories and a level further down, in a scored
    group's; the unpacker never gathers more than a MiB of them, whatever the slices' sizes, with
    msgpack's C unpacker and its pure-Python one."""
    from msgpack import fallback

    import proto.base as base
    from proto.arrays import PIECE_BYTES

    group = ex.example_group(2, tokens=6000, turns=3, prompt_tokens=100, routed_experts=(48, 8))
    message = ex.example_scored(group) if scored else group
    wire = encode(message)
    routes = sum(t.routed_experts.nbytes for t in group.trajectories)
    unpacked: list[int] = []  # the bytes each unpack() took
    taken: list[bytes] = []  # what each read_bytes() gave
    c_unpacker = msgpack.Unpacker  # the name is patched below
    for unpacker in (c_unpacker, fallback.Unpacker):

        class Measured(unpacker):
            def unpack(self):
                start = self.tell()
                value = super().unpack()
                unpacked.append(self.tell() - start)
                return value

            def read_bytes(self, n):
                taken.append(super().read_bytes(n))
                return taken[-1]

        monkeypatch.setattr(base.msgpack, "Unpacker", Measured)
        for step in (4 << 20, (1 << 20) + 7, 300_001):
            unpacked.clear()
            taken.clear()
            slices = [wire[i : i + step] for i in range(0, len(wire), step)]
            assert decode(type(message), slices) == message
            assert max(unpacked) < PIECE_BYTES
            assert routes < sum(map(len, taken)) < routes + 100  # the routes, and the 5-byte headers
            whole = [piece for piece in taken if any(piece is s for s in slices)]
            if unpacker is c_unpacker:  # the pure-Python one takes what it likes
                assert all(len(piece) <= PIECE_BYTES or piece in whole for piece in taken)
                assert bool(whole) == (step < 2 << 20)  # bins of 2.3 MB hold whole slices of less


def test_a_large_bin_that_runs_past_the_payload_fails_before_anything_is_read():
    import proto.base as base
    from proto.arrays import PIECE_BYTES

    def thirds(wire: bytes) -> list[bytes]:
        return [wire[: len(wire) // 3], wire[len(wire) // 3 :]]

    wire = msgpack.packb({"a": {"data": b"x" * (2 * PIECE_BYTES)}}, use_bin_type=True)
    assert base._unpacked_slices(thirds(wire)) == msgpack.unpackb(wire)
    with pytest.raises(ValueError, match="runs past the payload's end"):
        decode(TrajectoryGroup, thirds(wire[:-1]))
    with pytest.raises(ValueError, match="runs past the payload's end"):  # claims 4 GiB
        decode(TrajectoryGroup, thirds(b"\x81\xa1a\xc6\xff\xff\xff\xff" + b"x" * (2 * PIECE_BYTES)))
    with pytest.raises(ValueError, match="not valid msgpack"):  # cut inside the header
        decode(TrajectoryGroup, [b"\x81\xa1a", b"\xc6\x00"])


def test_a_large_bin_whose_header_spans_short_slices_comes_back_whole():
    """The reader gives at most the rest of a slice, so the 5-byte header of a bin past a MiB can
    come in several pieces: a value after the bin, and the bin's last bytes, come back as they were."""
    import proto.base as base
    from proto.arrays import PIECE_BYTES

    big = b"\0" * (2 * PIECE_BYTES - 3) + b"\xc4\x05q"  # ends in what looks like a bin's header
    for value in ({"a": {"data": big, "n": 1}, "z": 2}, {"a": [big, "xyz"]}):
        wire = msgpack.packb(value, use_bin_type=True)
        i = wire.index(b"\xc6")
        cuts = [[wire[:i], wire[i : i + k], wire[i + k :]] for k in range(1, 5)]
        cuts += [[wire[: i + 1], wire[i + 1 : i + 2], wire[i + 2 :]]]
        cuts += [[wire[:i], *(wire[j : j + 1] for j in range(i, i + 6)), wire[i + 6 :]]]
        for slices in cuts:
            assert base._unpacked_slices(slices) == msgpack.unpackb(wire, raw=False)


def test_the_slice_reader_reads_across_slices_in_parts():
    from proto.base import _SliceReader

    reader = _SliceReader([b"abcde", b"", b"fg"])
    assert [reader.byte_at(i) for i in (0, 4, 5, 6, 7)] == [*b"aefg", None]
    assert [reader.read(2), reader.read(2), reader.read(10), reader.read(), reader.read(1)] == [
        b"ab",
        b"cd",
        b"e",
        b"fg",
        b"",
    ]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_encode_parts_join_to_the_wire_form(message):
    assert b"".join(encode_parts(message)) == encode(message)


def test_a_large_array_is_encoded_as_its_pieces_and_what_lies_between_is_joined():
    """The parts of a group with routes: about a MiB each (an array's piece as it is, the small
    values between pieces joined up to a MiB), never one copy of the whole."""
    group = ex.example_group(3, tokens=40_000, turns=50, routed_experts=(8, 8))
    parts = encode_parts(group)
    assert b"".join(parts) == encode(group)
    size = sum(map(len, parts))
    assert max(map(len, parts)) < 1.5 * PIECE_BYTES
    # the small values (183 pieces here) joined: about one part a MiB, one more for each array
    assert len(parts) <= size // PIECE_BYTES + 3 + 1

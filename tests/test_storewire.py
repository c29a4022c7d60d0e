"""The store front's framing of torch's TCPStore protocol and its ledger, over generated request streams:
every request framed exactly as sent (whatever the chunks the bytes arrive in), malformed and oversized ones
refused as soon as their header says so, and the ledger's bytes and keys equal to a model of the store."""

from __future__ import annotations

import random
import struct

import pytest

from phoenixft.controlplane import storewire
from phoenixft.controlplane.storewire import Framer, Ledger, Limits, Malformed, Refused


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def encode(op: int, keys: list[bytes], values: list[bytes], expected: bytes = b"") -> bytes:
    """A request as torch's client writes it."""
    if op in (0, 13):
        return bytes([op]) + b"\x01\x02\x03\x04"
    if op == 4:
        return bytes([op]) + _s(keys[0]) + struct.pack("<q", 5)
    if op in (1, 9, 14):
        return bytes([op]) + _s(keys[0]) + _s(values[0])
    if op == 2:
        return bytes([op]) + _s(keys[0]) + _s(expected) + _s(values[0])
    if op in (3, 8, 15, 16):
        return bytes([op]) + _s(keys[0])
    if op in (5, 6, 10):
        return bytes([op]) + struct.pack("<Q", len(keys)) + b"".join(_s(k) for k in keys)
    if op == 11:
        pairs = b"".join(_s(k) + _s(v) for k, v in zip(keys, values, strict=True))
        return bytes([op]) + struct.pack("<Q", len(keys)) + pairs
    return bytes([op])  # 7, 12, 17


def generated(rng: random.Random, n: int) -> list[tuple[int, list[bytes], list[bytes], bytes]]:
    out = []
    for _ in range(n):
        op = rng.choice(sorted(storewire.OPS))
        nk = rng.randint(1, 4) if op in (5, 6, 10, 11) else 1
        keys = [f"/k{rng.randrange(12)}".encode() for _ in range(nk)]
        values = [bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 9, 300]))) for _ in range(nk)]
        out.append((op, keys, values, bytes(rng.randrange(256) for _ in range(rng.choice([0, 3])))))
    return out


class Model:
    """The store as the ledger should see it: value sizes, queues."""

    def __init__(self) -> None:
        self.sizes: dict[bytes, int] = {}
        self.queues: dict[bytes, list[int]] = {}

    def apply(self, op: int, keys: list[bytes], values: list[bytes]) -> None:
        if op in (1, 11):
            for k, v in zip(keys, values, strict=False):
                self.sizes[k] = len(v)
        elif op == 2:
            self.sizes[keys[0]] = max(len(values[0]), self.sizes.get(keys[0], 0))
        elif op == 9:
            self.sizes[keys[0]] = self.sizes.get(keys[0], 0) + len(values[0])
        elif op == 4:
            self.sizes[keys[0]] = max(20, self.sizes.get(keys[0], 0))
        elif op == 8:
            self.sizes.pop(keys[0], None)
        elif op == 14:
            self.queues.setdefault(keys[0], []).append(len(values[0]))
        elif op == 15 and self.queues.get(keys[0]):
            self.queues[keys[0]].pop(0)
            if not self.queues[keys[0]]:
                del self.queues[keys[0]]

    def totals(self) -> tuple[int, int]:
        return (sum(self.sizes.values()) + sum(sum(q) for q in self.queues.values()),
                len(self.sizes) + len(self.queues))


def test_requests_are_framed_as_sent_whatever_the_chunks() -> None:
    """2,000 generated streams of requests of every operation, cut into random chunks: each request comes out
    whole, in order, byte for byte, with its keys and values; the ledger's totals equal the model's."""
    rng = random.Random(20261207)
    for _ in range(2000):
        reqs = generated(rng, rng.randint(1, 12))
        stream = b"".join(encode(*r) for r in reqs)
        fr, ledger, model = Framer(Limits()), Ledger(Limits()), Model()
        got: list[storewire.Request] = []
        at = 0
        while at < len(stream):
            n = rng.choice([1, 2, 7, 64, 4096])
            for req in fr.feed(stream[at:at + n]):
                ledger.admit(req)
                got.append(req)
            at += n
        assert fr.buffered() == 0
        assert [r.raw for r in got] == [encode(*r) for r in reqs]
        for r, (op, keys, values, expected) in zip(got, reqs, strict=True):
            assert r.op == op and r.name == storewire.OPS[op]
            assert r.answered == (op in storewire.ANSWERED)
            if op not in (0, 7, 12, 13, 17):
                assert r.keys == keys[: len(r.keys)] and r.keys
            if op in (1, 9, 11, 14):
                assert r.values == values[: len(r.values)]
            if op == 2:
                assert r.expected == expected and r.values == values[:1]
            model.apply(op, keys if op in (5, 6, 10, 11) else keys[:1], values if op == 11 else values[:1])
        assert (ledger.bytes, ledger.keys) == model.totals()


def test_malformed_and_oversized_requests_are_refused_from_their_header() -> None:
    lim = Limits(max_key=16, max_value=100, max_bytes=550, max_keys=5, max_key_count=3)
    for bad in (b"\x12", b"\xff" + b"\x00" * 20, b"\x01" + struct.pack("<Q", 9000) + b"x",  # past torch's own
                b"\x05" + struct.pack("<Q", 4)):
        with pytest.raises(Malformed):
            Framer(lim).feed(bad)
    with pytest.raises(Refused, match="a key of 17 bytes"):  # (within torch's limits: refused, not malformed)
        Framer(lim).feed(b"\x03" + struct.pack("<Q", 17))
    with pytest.raises(Refused, match="a value of 101 bytes"):
        Framer(lim).feed(b"\x01" + _s(b"/a") + struct.pack("<Q", 101))  # (refused before the value's bytes come)
    ledger = Ledger(lim)
    for i in range(5):
        ledger.admit(Framer(lim).feed(encode(1, [f"/k{i}".encode()], [b"v" * 100]))[0])
    with pytest.raises(Refused, match="past 5 keys"):
        ledger.admit(Framer(lim).feed(encode(1, [b"/k9"], [b"v"]))[0])
    with pytest.raises(Refused, match="past 550 bytes"):
        ledger.admit(Framer(lim).feed(encode(9, [b"/k0"], [b"v" * 100]))[0])
    assert (ledger.bytes, ledger.keys) == (500, 5)  # (what was refused was not counted)
    ledger.admit(Framer(lim).feed(encode(8, [b"/k0"], []))[0])
    ledger.admit(Framer(lim).feed(encode(1, [b"/k9"], [b"v" * 100]))[0])  # (room again once a key is deleted)
    assert (ledger.bytes, ledger.keys) == (500, 5)
    with pytest.raises(ValueError):
        Limits(max_value=storewire.TORCH_MAX_VALUE + 1)

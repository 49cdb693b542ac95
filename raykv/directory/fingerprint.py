"""Fixed-width fingerprints of directory keys, computed a batch at a time.

The directory stores a 64-bit fingerprint of each key, computed over the
WHOLE key (identity tag + block hash + group index): a fingerprint of a slice
would make keys of two identities that share the slice collide systematically.
A collision (two keys with one fingerprint, about n^2 / 2^65 for n keys) can
only cost a miss: holders look blocks up by the full key and answer "not held"
for a key they do not have, which fails that load into a recompute.

The hash runs in numpy over a whole batch (``PackedKeys``: the keys joined
into one buffer, read once): each key's bytes, zero-padded to 8-byte words,
go through xxh64's round (multiply, rotate, multiply) seeded with the key's
length, then murmur3's 64-bit finaliser, so every output bit (the table's
bucket bits included) depends on every input bit. A per-key call into a C
hash cost more than this on large batches: the Python loop, not the hashing,
was the price.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

#: Fingerprint 0 marks an empty slot of a ``FingerprintTable``; a key hashing to 0 uses 1.
EMPTY = 0

# xxh64's primes and murmur3's finaliser constants, as Python ints (``_hash_one``)
# and as numpy scalars (``_hash_rows``).
P1, P2, P4, P5 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
F1, F2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
_P1, _P2, _P4, _F1, _F2 = (np.uint64(c) for c in (P1, P2, P4, F1, F2))
_SEED = 0x5CA1AB1E0DDBA11C
_MASK = 2**64 - 1
#: Batches smaller than this hash key by key in Python (the same function): numpy's
#: fixed cost per operation (~70 of them per batch) is more than theirs.
SMALL_BATCH = 24


class PackedKeys:
    """A batch of keys joined into one ``uint8`` buffer (one pass over the key
    objects), with each key's length and offset. Keys must be bytes-like;
    ``length``, when given, is every key's length (one pass fewer).
    ``length`` is then the length every key has (None: several, or no keys)."""

    __slots__ = ("buf", "lengths", "offsets", "length")

    def __init__(self, keys: Sequence[bytes], length: int | None = None) -> None:
        self.buf = np.frombuffer(b"".join(keys), dtype=np.uint8)
        n = len(keys)
        if length is not None and len(self.buf) == n * length:
            self.lengths = np.full(n, length, dtype=np.int64)
        else:
            self.lengths = np.fromiter(map(len, keys), dtype=np.int64, count=n)
            first = int(self.lengths[0]) if n else None
            length = first if n and (self.lengths == first).all() else None
        self.length = length if n else None
        self.offsets = np.cumsum(self.lengths) - self.lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def groups(self) -> list[tuple[int, np.ndarray | None, np.ndarray]]:
        """Per distinct key length: (length, positions or None for all keys, ``(m, length)`` byte rows)."""
        if self.length is not None:
            return [(self.length, None, self.buf.reshape(len(self), self.length))]
        out: list[tuple[int, np.ndarray | None, np.ndarray]] = []
        for length in np.unique(self.lengths).tolist():
            pos = np.flatnonzero(self.lengths == length)
            rows = self.buf[self.offsets[pos][:, None] + np.arange(length)]
            out.append((length, pos, rows))
        return out

    def bytes_at(self, start_from_end: int, width: int) -> np.ndarray:
        """``(n, width)`` bytes of every key starting ``start_from_end`` bytes
        before its end (every key must be at least that long)."""
        start = self.offsets + self.lengths - start_from_end
        return self.buf[start[:, None] + np.arange(width)]


def _rotl(x: np.ndarray, r: int, tmp: np.ndarray) -> None:
    np.right_shift(x, np.uint64(64 - r), out=tmp)
    np.left_shift(x, np.uint64(r), out=x)
    np.bitwise_or(x, tmp, out=x)


def _hash_rows(rows: np.ndarray, length: int) -> np.ndarray:
    """The fingerprint of each ``(m, length)`` row of key bytes."""
    m = len(rows)
    words_n = -(-length // 8)
    if length % 8 or not rows.flags.c_contiguous:
        padded = np.zeros((m, words_n * 8), dtype=np.uint8)
        padded[:, :length] = rows
        rows = padded
    words = rows.view("<u8").reshape(m, words_n)
    h = np.full(m, (_SEED ^ (length * P5)) & _MASK, dtype=np.uint64)
    k = np.empty(m, dtype=np.uint64)
    tmp = np.empty(m, dtype=np.uint64)
    for j in range(words_n):
        np.multiply(words[:, j], _P2, out=k)
        _rotl(k, 31, tmp)
        np.multiply(k, _P1, out=k)
        np.bitwise_xor(h, k, out=h)
        _rotl(h, 27, tmp)
        np.multiply(h, _P1, out=h)
        np.add(h, _P4, out=h)
    for mult in (_F1, _F2, None):  # murmur3's fmix64
        np.right_shift(h, np.uint64(33), out=tmp)
        np.bitwise_xor(h, tmp, out=h)
        if mult is not None:
            np.multiply(h, mult, out=h)
    return h


def _hash_one(key: bytes) -> int:
    """``_hash_rows`` of one key, in Python ints (small batches)."""
    length = len(key)
    h = (_SEED ^ (length * P5)) & _MASK
    for (word,) in struct.iter_unpack("<Q", bytes(key) + b"\0" * (-length % 8)):
        k = (word * P2) & _MASK
        k = ((k << 31) | (k >> 33)) & _MASK
        h ^= (k * P1) & _MASK
        h = ((h << 27) | (h >> 37)) & _MASK
        h = (h * P1 + P4) & _MASK
    h ^= h >> 33
    h = (h * F1) & _MASK
    h ^= h >> 33
    h = (h * F2) & _MASK
    h ^= h >> 33
    return h or 1


def packed_fingerprints(packed: PackedKeys) -> np.ndarray:
    """The fingerprint of every key of ``packed``, as a ``uint64`` array (never ``EMPTY``)."""
    groups = packed.groups()
    if len(groups) == 1 and groups[0][1] is None:  # one key length: no scatter
        out = _hash_rows(groups[0][2], groups[0][0])
    else:
        out = np.empty(len(packed), dtype=np.uint64)
        for length, pos, rows in groups:
            out[pos] = _hash_rows(rows, length)
    out[out == EMPTY] = 1
    return out


def fingerprints(keys: Sequence[bytes]) -> np.ndarray:
    """The fingerprint of every key, as a ``uint64`` array (never ``EMPTY``)."""
    if len(keys) < SMALL_BATCH:
        return np.fromiter(map(_hash_one, keys), dtype=np.uint64, count=len(keys))
    return packed_fingerprints(PackedKeys(keys))


def fingerprint(key: bytes) -> int:
    """One key's fingerprint (``fingerprints([key])[0]``)."""
    return _hash_one(key)


def to_blob(fps: np.ndarray) -> bytes:
    """Fingerprints as the bytes that travel in directory calls (little-endian uint64)."""
    return np.ascontiguousarray(fps, dtype="<u8").tobytes()


def from_blob(blob: bytes | np.ndarray | Sequence[bytes]) -> np.ndarray:
    """Fingerprints from a call's blob (or from keys, for callers that send keys)."""
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return np.frombuffer(blob, dtype="<u8").astype(np.uint64, copy=False)
    if isinstance(blob, np.ndarray):
        return blob.astype(np.uint64, copy=False)
    return fingerprints(list(blob))

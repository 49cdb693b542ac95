"""Fixed-width fingerprints of directory keys.

The directory stores a 64-bit xxh3 fingerprint of each key, computed over the
WHOLE key (identity tag + block hash + group index): a fingerprint of a slice
would make keys of two identities that share the slice collide systematically.
A collision (two keys with one fingerprint, about n^2 / 2^65 for n keys) can
only cost a miss: holders look blocks up by the full key and answer "not held"
for a key they do not have, which fails that load into a recompute.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

#: Fingerprint 0 marks an empty slot of a ``FingerprintTable``; a key hashing to 0 uses 1.
EMPTY = 0

_xxh3 = xxhash.xxh3_64_intdigest


def fingerprints(keys: Sequence[bytes]) -> np.ndarray:
    """The fingerprint of every key, as a ``uint64`` array (never ``EMPTY``)."""
    out = np.fromiter(map(_xxh3, keys), dtype=np.uint64, count=len(keys))
    out[out == EMPTY] = 1
    return out


def fingerprint(key: bytes) -> int:
    """One key's fingerprint (``fingerprints([key])[0]``)."""
    return _xxh3(key) or 1


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

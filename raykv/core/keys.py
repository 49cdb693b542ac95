"""Offload keys: prefix-chained block hashes plus a group index.

An ``OffloadKey`` is ``block_hash + group_idx.to_bytes(4, "big")``, the same
layout vLLM uses (``vllm.v1.kv_offload.base.make_offload_key``). A block's hash
covers its parent's hash, its token ids and any extra keys (a per-tenant
``cache_salt``, multimodal hashes...), so equal keys mean equal KV everywhere.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NewType, cast

from raykv.core.validate import ArgumentError, int_arg, sequence_arg

OffloadKey = NewType("OffloadKey", bytes)

GROUP_IDX_BYTES = 4
#: Longest offload key raykv accepts (block hash + group index).
MAX_KEY_BYTES = 256
#: Hash of the (virtual) parent of a request's first block.
ROOT_HASH = hashlib.sha256(b"raykv-root").digest()


MAX_GROUP_IDX = 2 ** (8 * GROUP_IDX_BYTES) - 1
#: The group index of pending keys (``pending_key``): vLLM's groups count from 0 and
#: engine-cache keys use ``0xFFFFFFFF``, so no tier key ever has it.
PENDING_GROUP = b"\xff\xff\xff\xfe"


def pending_key(key: bytes) -> bytes:
    """The directory key for "an engine is computing the block of ``key`` now"
    (``key``: a scoped offload key, identity and tenant included). Its own key
    family: tier lookups never see pending entries, so none is ever a HIT."""
    return key[:-GROUP_IDX_BYTES] + PENDING_GROUP


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """Join a block hash and a KV-cache group index into an offload key."""
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise ArgumentError("block_hash", f"must be bytes, got {type(block_hash).__name__}")
    block_hash = bytes(block_hash)
    if not 1 <= len(block_hash) <= MAX_KEY_BYTES - GROUP_IDX_BYTES:
        raise ArgumentError("block_hash", f"must be 1..{MAX_KEY_BYTES - GROUP_IDX_BYTES} bytes, got {len(block_hash)}")
    group_idx = int_arg("group_idx", group_idx, minimum=0, maximum=MAX_GROUP_IDX)
    return OffloadKey(block_hash + group_idx.to_bytes(GROUP_IDX_BYTES, "big"))


def key_block_hash(key: bytes) -> bytes:
    """The block-hash part of an offload key."""
    return bytes(key[:-GROUP_IDX_BYTES])


def key_group_idx(key: bytes) -> int:
    """The group-index part of an offload key."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def validate_keys(keys: object, name: str = "keys") -> list[OffloadKey]:
    """``keys`` (a sequence of offload keys) as bytes; ``ArgumentError`` naming
    the argument and the first bad key (a str, bytes or ints is not a key list)."""
    return cast("list[OffloadKey]", checked_keys(keys, name)[0])


def checked_keys(keys: object, name: str = "keys") -> tuple[list[bytes], int | None]:
    """``validate_keys``, plus the length every key has (None: several lengths, or no keys)."""
    items = sequence_arg(name, keys)
    lengths = _bytes_lengths(items)
    if lengths is not None and (not lengths or (min(lengths) > GROUP_IDX_BYTES and max(lengths) <= MAX_KEY_BYTES)):
        valid = cast("Sequence[bytes]", items)  # every item is bytes of a key's length
        return (valid if type(valid) is list else list(valid)), _one_length(lengths)
    out = []
    for i, key in enumerate(items):
        try:
            out.append(validate_key(key))
        except ValueError as e:
            raise ArgumentError(f"{name}[{i}]", str(e)) from None
    return out, _one_length({len(k) for k in out})


def bytes_and_length(keys: Sequence[bytes]) -> tuple[list[bytes], int | None]:
    """``keys`` as a list of ``bytes`` (not validated), and the length every key has
    (None: several lengths, or no keys)."""
    lengths = _bytes_lengths(keys)
    if lengths is None:
        keys = [bytes(k) for k in keys]
        lengths = {len(k) for k in keys}
    return (keys if type(keys) is list else list(keys)), _one_length(lengths)


def _bytes_lengths(keys: Sequence[object]) -> set[int] | None:
    """The distinct lengths of ``keys`` when every one is ``bytes``, else None: one
    pass and no Python call per key (on large batches each pass over the key
    objects costs a cache miss per key, more than fingerprinting them)."""
    try:
        return set(map(bytes.__len__, cast("Sequence[bytes]", keys)))  # raises for anything but bytes
    except TypeError:
        return None


def _one_length(lengths: set[int]) -> int | None:
    return next(iter(lengths)) if len(lengths) == 1 else None


def validate_key(key: object) -> bytes:
    """Return ``key`` as bytes, or raise ``ValueError`` for a malformed key."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ValueError(f"offload key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) <= GROUP_IDX_BYTES or len(key) > MAX_KEY_BYTES:
        raise ValueError(f"offload key must be 5..256 bytes (hash + 4-byte group index), got {len(key)}")
    return key


def _encode_extra(extra: object) -> bytes:
    if isinstance(extra, bytes):
        return b"b" + extra
    if isinstance(extra, str):
        return b"s" + extra.encode()
    if isinstance(extra, int):
        return b"i" + str(extra).encode()
    if isinstance(extra, (tuple, list)):
        return b"t" + b"".join(struct.pack(">I", len(e)) + e for e in map(_encode_extra, extra))
    raise TypeError(f"unsupported extra key type {type(extra).__name__}")


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: Iterable[object] = ()) -> bytes:
    """SHA-256 of (parent hash, token ids, extra keys): one block's chained hash."""
    h = hashlib.sha256(parent_hash if parent_hash is not None else ROOT_HASH)
    h.update(struct.pack(">I", len(token_ids)))
    h.update(struct.pack(f">{len(token_ids)}q", *token_ids))
    for extra in extra_keys:
        enc = _encode_extra(extra)
        h.update(struct.pack(">I", len(enc)) + enc)
    return h.digest()


def prefix_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: str | None = None,
    group_idx: int = 0,
) -> list[OffloadKey]:
    """Offload keys of every full block of ``token_ids``.

    ``salt`` (vLLM's ``cache_salt``) is mixed into the first block only; since
    hashes are chained, every later key differs too, so tenants never share KV.
    """
    block_size = int_arg("block_size", block_size, minimum=1)
    group_idx = int_arg("group_idx", group_idx, minimum=0, maximum=MAX_GROUP_IDX)
    if salt is not None and not isinstance(salt, str):
        raise ArgumentError("salt", f"must be a str or None, got {type(salt).__name__}")
    token_ids = _token_ids(token_ids)
    keys: list[OffloadKey] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        extra = (salt,) if (i == 0 and salt is not None) else ()
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        keys.append(make_offload_key(parent, group_idx))
    return keys


_INT64 = (-(2**63), 2**63 - 1)


def _token_ids(token_ids: object) -> Sequence[int]:
    """Token ids as given when they are a valid int sequence (ints in int64)."""
    items = sequence_arg("token_ids", token_ids)
    ints = cast("Sequence[int]", items)  # checked next: an int array, or every item an int in int64
    dtype = getattr(items, "dtype", None)
    if dtype is not None:
        if dtype.kind not in "iu":
            raise ArgumentError("token_ids", f"must hold ints, got an array of {dtype}")
        return [int(t) for t in ints]
    if all(type(t) is int for t in items) and (not ints or _INT64[0] <= min(ints) and max(ints) <= _INT64[1]):
        return ints  # the common case, checked without a call per token
    for i, t in enumerate(items):
        int_arg(f"token_ids[{i}]", t, minimum=_INT64[0], maximum=_INT64[1])
    return ints


#: Bytes of a key that pick its directory shard: the block hash's last 8 bytes
#: (a scoped key's head is its identity tag, the same for all of one engine's keys).
SHARD_SLICE = slice(-12, -4)


def shard_of(key: bytes, num_shards: int) -> int:
    """Directory shard owning ``key``: the last 8 bytes of its block hash
    (uniform); keys shorter than 12 bytes use their head."""
    part = key[SHARD_SLICE] if len(key) >= 12 else key[:8]
    return int.from_bytes(part, "big") % num_shards

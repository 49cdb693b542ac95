"""The fs tier's block file format and key -> path mapping.

A block file is a small header followed by the block's bytes::

    offset  size  field
    0       4     magic  b"RKVB"
    4       2     format version (1)
    6       1     payload checksum algorithm (1 crc32, 2 crc32c, 3 xxh3_64, 4 blake3/64)
    7       1     flags (0)
    8       2     key length K (1..264: an 8-byte identity tag + an offload key of up to 256)
    10      2     header length H (32 + K rounded up to a multiple of 64)
    12      4     header checksum (zlib.crc32 of bytes 0..12, 16..32 and the key)
    16      8     payload length N
    24      8     payload checksum
    32      K     the offload key
    32+K    ...   zero padding up to H
    H       N     payload

All integers little-endian. The payload starts at a 64-byte boundary. A file
is valid only if its size is exactly H + N, both checksums match and the key
in the header is the key that was asked for; anything else fails the load of
that key (``FormatError``). A file whose checksum algorithm is not installed
on the reading node fails with ``ChecksumUnavailable`` (an I/O-type error: the
file is not corrupt and is kept).

Checksums: ``zlib.crc32`` is always there (~3.5-4 GB/s per core here) and is
the dominant cost of the tier next to raw file I/O for 2 MiB blocks, so the
writer uses the fastest installed one by default ("auto"): ``xxhash``'s xxh3
(~60 GB/s, what RocksDB defaults to), the ``crc32c`` package (hardware CRC32C,
~26 GB/s), ``blake3`` (~6 GB/s, installed wherever vLLM is), else crc32. All
release the GIL on large buffers.

Paths come only from the key's hex digits (never from user input). Keys are
identity-scoped (``raykv.core.identity``: an 8-byte identity tag, then the block
hash), so each engine identity gets a folder of its own, as in vLLM's fs tier:
``<root>/<tag hex>/<3 hex digits of the block hash>/<key hex>.kv`` (4,096
leaves per identity). Keys longer than ``MAX_HEX_NAME_KEY`` bytes are named by
their SHA-256 instead (``h<sha>.kv``, the key itself still lives in the
header; the fan-out then uses the SHA's digits).
"""

from __future__ import annotations

import hashlib
import importlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

MAGIC = b"RKVB"
VERSION = 1
_FIXED = struct.Struct("<4sHBBHHIQQ")  # 32 bytes
FIXED_SIZE = _FIXED.size
ALIGN = 64
#: Bytes of a scoped key's identity tag (``raykv.core.identity.TAG_BYTES``).
TAG_BYTES = 8
#: Longest key a block file holds: an identity tag plus the longest offload key
#: (``raykv.core.keys.MAX_KEY_BYTES``, 256).
MAX_KEY_BYTES = TAG_BYTES + 256
MAX_HEX_NAME_KEY = 100  # 200 hex chars + ".kv" stays well under NAME_MAX (255)
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
#: Folder under the root where writers keep their unfinished stores, one sub-folder per writer
#: process: a killed writer's leftovers are found there without listing the block folders.
TMP_DIR = ".tmp"

assert FIXED_SIZE == 32


class FormatError(ValueError):
    """A block file is not a valid block of the requested key (corrupt/truncated)."""


class ChecksumUnavailable(RuntimeError):
    """The file's checksum algorithm is not installed here (the file may be fine)."""


# -- checksums -----------------------------------------------------------------
Checksum = Callable[["bytes | memoryview"], int]
ALGORITHMS = {"crc32": 1, "crc32c": 2, "xxh3": 3, "blake3": 4}
ALGORITHM_NAMES = {v: k for k, v in ALGORITHMS.items()}
AUTO_ORDER = ("xxh3", "crc32c", "blake3", "crc32")  # fastest first
PACKAGES = {"crc32": "(stdlib)", "crc32c": "crc32c", "xxh3": "xxhash", "blake3": "blake3"}
_impls: dict[int, Checksum | None] = {}


def _make(name: str) -> Checksum | None:
    try:
        if name == "crc32":
            return zlib.crc32
        if name == "crc32c":
            return importlib.import_module("crc32c").crc32c
        if name == "xxh3":
            return importlib.import_module("xxhash").xxh3_64_intdigest
        if name == "blake3":
            b3 = importlib.import_module("blake3").blake3
            return lambda data: int.from_bytes(b3(data, max_threads=1).digest(8), "little")
    except Exception:  # not installed (or broken): unavailable
        return None
    raise ValueError(f"unknown checksum algorithm {name!r}")


def checksum_impl(algo: int) -> Checksum:
    """The checksum function of algorithm id ``algo`` (raises ``ChecksumUnavailable``)."""
    if algo not in _impls:
        name = ALGORITHM_NAMES.get(algo)
        _impls[algo] = _make(name) if name else None
    impl = _impls[algo]
    if impl is None:
        name = ALGORITHM_NAMES.get(algo, f"#{algo}")
        raise ChecksumUnavailable(
            f"block checksum algorithm {name!r} is not available on this node"
            + (f" (pip install {PACKAGES[name]})" if name in PACKAGES else "")
        )
    return impl


def available_algorithms() -> list[str]:
    out = []
    for name in AUTO_ORDER:
        try:
            checksum_impl(ALGORITHMS[name])
            out.append(name)
        except ChecksumUnavailable:
            pass
    return out


def resolve_algorithm(name: str) -> int:
    """Algorithm id for an option value ("auto" = fastest installed)."""
    if name == "auto":
        return ALGORITHMS[available_algorithms()[0]]
    algo = ALGORITHMS[name]
    checksum_impl(algo)
    return algo


def check_algorithm(value: str) -> str | None:
    """``opt(check=...)`` for the ``checksum`` option."""
    if value == "auto":
        return None
    if value not in ALGORITHMS:
        return f"must be one of 'auto', {', '.join(repr(a) for a in ALGORITHMS)}; got {value!r}"
    try:
        checksum_impl(ALGORITHMS[value])
    except ChecksumUnavailable as e:
        return str(e)
    return None


def header_size(key_len: int) -> int:
    return -(-(FIXED_SIZE + key_len) // ALIGN) * ALIGN


def _header_crc(head: "bytes | memoryview", key: bytes) -> int:
    return zlib.crc32(key, zlib.crc32(head[16:32], zlib.crc32(head[:12])))


def encode_header(key: bytes, payload: "bytes | memoryview", algo: int = ALGORITHMS["crc32"]) -> bytes:
    """The header bytes (length ``header_size(len(key))``) for ``payload``."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    digest = checksum_impl(algo)(payload) & 0xFFFFFFFFFFFFFFFF
    hlen = header_size(len(key))
    head = _FIXED.pack(MAGIC, VERSION, algo, 0, len(key), hlen, 0, len(payload), digest)
    head = head[:12] + struct.pack("<I", _header_crc(head, key)) + head[16:]
    return head + key + bytes(hlen - FIXED_SIZE - len(key))


@dataclass(frozen=True)
class Header:
    key: bytes
    algo: int
    header_len: int
    payload_len: int
    payload_checksum: int


def decode_header(buf: "bytes | memoryview") -> Header:
    """Parse and verify a header (raises ``FormatError``)."""
    buf = memoryview(buf)
    if len(buf) < FIXED_SIZE:
        raise FormatError(f"file too short for a header ({len(buf)} bytes)")
    magic, version, algo, _flags, klen, hlen, hcrc, plen, digest = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise FormatError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise FormatError(f"unsupported format version {version}")
    if not 0 < klen <= MAX_KEY_BYTES or hlen != header_size(klen) or len(buf) < FIXED_SIZE + klen:
        raise FormatError(f"bad key/header length {klen}/{hlen}")
    key = bytes(buf[FIXED_SIZE : FIXED_SIZE + klen])
    if _header_crc(buf, key) != hcrc:
        raise FormatError("header checksum mismatch")
    return Header(key, algo, hlen, plen, digest)


def verify(header_buf: "bytes | memoryview", key: bytes, payload: "bytes | memoryview", file_len: int) -> None:
    """Check a loaded block against ``key``: header, lengths, payload checksum."""
    h = decode_header(header_buf)
    if h.key != key:
        raise FormatError("header holds another key")
    if h.payload_len != len(payload):
        raise FormatError(f"payload length {h.payload_len} != block size {len(payload)}")
    if file_len != h.header_len + h.payload_len:
        raise FormatError(f"file length {file_len} != {h.header_len + h.payload_len} (truncated or overlong)")
    if checksum_impl(h.algo)(payload) & 0xFFFFFFFFFFFFFFFF != h.payload_checksum:
        raise FormatError(f"payload checksum mismatch ({ALGORITHM_NAMES.get(h.algo, h.algo)})")


# -- names -----------------------------------------------------------------
def file_name(key: bytes) -> str:
    """Base name of ``key``'s block file."""
    if len(key) <= MAX_HEX_NAME_KEY:
        return key.hex() + SUFFIX
    return "h" + hashlib.sha256(key).hexdigest() + SUFFIX


#: Hex digits of the per-identity fan-out directories.
FAN_DIGITS = 3


def rel_dir(key: bytes) -> str:
    """Directory (relative to the root) of ``key``'s block file: its identity
    tag's folder, then a fan-out leaf."""
    name = file_name(key)
    fan = name[1 : 1 + FAN_DIGITS] if name.startswith("h") else name[2 * TAG_BYTES : 2 * TAG_BYTES + FAN_DIGITS]
    return f"{key[:TAG_BYTES].hex()}/{fan.ljust(FAN_DIGITS, '0')}"


def is_identity_dir(name: str) -> bool:
    """Whether a root entry's name is an identity folder."""
    return len(name) == 2 * TAG_BYTES and all(c in "0123456789abcdef" for c in name)


def is_legacy_dir(name: str) -> bool:
    """A first-level folder of the layout before identity scoping (``<hex[0:2]>``)."""
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def is_fan_dir(name: str) -> bool:
    """Whether an identity folder's entry is a fan-out leaf."""
    return len(name) == FAN_DIGITS and all(c in "0123456789abcdef" for c in name)


def rel_path(key: bytes) -> str:
    return f"{rel_dir(key)}/{file_name(key)}"


def key_from_name(name: str) -> bytes | None:
    """The key a hex-named block file holds; None if the name does not say
    (hashed names: read the header) or is not a block file."""
    if not name.endswith(SUFFIX) or name.startswith((".", "h")):
        return None
    try:
        return bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None


def is_hashed_name(name: str) -> bool:
    return name.startswith("h") and name.endswith(SUFFIX)


def is_tmp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)

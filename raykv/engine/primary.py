"""The CPU primary tier's byte region: a shared-memory file viewed as
``(num_chunks, bytes_per_chunk)``, as vLLM's ``SharedOffloadRegion`` does.

Tier actors on the same node map the same file, so block bytes move between
the primary and plasma/storage without passing through actor-call arguments.
"""

from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class RegionHandle:
    """Where a primary view lives, so another process on the node can map it."""

    path: str  # a file path, or /proc/<pid>/fd/<n> for an unlinked file
    offset: int  # byte offset of chunk 0 inside the file
    num_chunks: int
    bytes_per_chunk: int
    node_id: str | None = None

    @property
    def nbytes(self) -> int:
        return self.num_chunks * self.bytes_per_chunk


class PrimaryRegion:
    """An owner-only shared-memory file with a 2-D memoryview over it.

    The file's name is unlinked as soon as it is mapped and the descriptor
    stays open, as vLLM's ``SharedOffloadRegion`` does with a barrier: no exit
    path (SIGKILL included) can leak it in /dev/shm. Same-node tier actors map
    it through ``/proc/<pid>/fd/<n>`` (see ``describe_region``).
    """

    def __init__(self, num_chunks: int, bytes_per_chunk: int, path: str | None = None) -> None:
        if num_chunks <= 0 or bytes_per_chunk <= 0:
            raise ValueError(f"num_chunks and bytes_per_chunk must be > 0, got {num_chunks}, {bytes_per_chunk}")
        self.num_chunks = num_chunks
        self.bytes_per_chunk = bytes_per_chunk
        self.path = path or os.path.join(SHM_DIR, f"raykv_primary_{uuid.uuid4().hex}.mmap")
        self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(self._fd, num_chunks * bytes_per_chunk)
            self._mmap = mmap.mmap(self._fd, num_chunks * bytes_per_chunk, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            raise
        finally:
            os.unlink(self.path)
        self.view: memoryview = memoryview(self._mmap).cast("B", (num_chunks, bytes_per_chunk))
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_chunks, bytes_per_chunk)

    def close(self) -> None:
        """Unmap and close; views handed out must be dropped first."""
        if self._fd < 0:
            return
        self.view.release()
        del self.array
        try:
            self._mmap.close()
        except BufferError:
            pass  # someone still holds an export; the mapping dies with them
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> "PrimaryRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def view_address(view: memoryview) -> int:
    """Address of the first byte of ``view``."""
    return np.frombuffer(view.cast("B") if view.ndim != 1 else view, dtype=np.uint8).ctypes.data


def describe_region(view: memoryview) -> RegionHandle:
    """Find the shared file behind ``view`` (via /proc/self/maps).

    Raises ``ValueError`` when the view is not backed by a file (plain process
    memory cannot be mapped by another process).
    """
    shape, strides = view.shape, view.strides
    if shape is None or strides is None or len(shape) != 2:
        raise ValueError(f"primary view must be 2-D, got shape {shape}")
    addr = np.asarray(view).ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if not lo <= addr < hi:
                continue
            if len(parts) < 6 or not parts[5].strip().startswith("/"):
                break
            path = parts[5].strip()
            offset = int(parts[2], 16) + (addr - lo)
            if path.endswith(" (deleted)"):
                path = _fd_path_of_deleted(path[: -len(" (deleted)")])
            return RegionHandle(path, offset, shape[0], strides[0])
    raise ValueError(
        "the primary view is not backed by a shared-memory file; create it with "
        "raykv.engine.primary.PrimaryRegion (vLLM's SharedOffloadRegion also works)"
    )


def _fd_path_of_deleted(path: str) -> str:
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == f"{path} (deleted)":
                return f"/proc/{os.getpid()}/fd/{fd}"
        except OSError:
            continue
    raise ValueError(f"primary region file {path} was unlinked and no descriptor is open")


class MappedRegion:
    """Another process's view of a ``RegionHandle`` (used by tier actors)."""

    def __init__(self, handle: RegionHandle) -> None:
        self.handle = handle
        page = mmap.ALLOCATIONGRANULARITY
        base = handle.offset - handle.offset % page
        self._skip = handle.offset - base
        fd = os.open(handle.path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, self._skip + handle.nbytes, flags=mmap.MAP_SHARED, offset=base)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=handle.nbytes, offset=self._skip).reshape(
            handle.num_chunks, handle.bytes_per_chunk
        )

    def close(self) -> None:
        del self.array
        try:
            self._mmap.close()
        except BufferError:
            pass

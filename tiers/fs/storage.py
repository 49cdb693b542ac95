"""Filesystem access for the fs tier: block files under a root.

Two implementations of one small interface:

- ``LocalStorage`` for POSIX paths (local disks, NFS/Lustre/EFS mounts):
  plain ``os`` calls. A store is ``checksum(slot)`` + one ``pwritev(header,
  slot)`` of a temp file opened ``O_EXCL`` with mode 0o600 in the block's
  directory, optional ``fsync`` (file and directory), ``rename``. A load is
  one ``preadv(header, slot, 1 spare byte)`` straight into the primary slot
  (the spare byte catches overlong files) and ``checksum(slot)``. No user-space
  copy besides the kernel's own page-cache copy.
- ``ArrowStorage`` for ``pyarrow.fs`` URIs (``s3://``, ``gs://``, ``hdfs://``,
  ``file://``...). Object stores (s3, gcs) get a single put (atomic); other
  filesystems a temp file and a move. Loads ``readinto`` the slot.

Both raise ``FileNotFoundError`` for a missing block, ``FormatError`` for a
corrupt one (bad header, wrong key, wrong length, checksum mismatch) and
``OSError`` for anything else; the tier tells them apart.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiers.fs import format as fmt

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from raykv.metrics.incidents import Removal

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def is_uri(root: str) -> bool:
    return "://" in root


#: Seconds the GCS client retries a failing call before it gives up. Its own default (pyarrow 26)
#: is 15 minutes: a bucket that cannot be reached (no credentials, no network) hung ``raykv
#: start`` and every job of the tier that long. A cache retries for seconds, then misses. A root
#: URI that sets ``retry_limit_seconds`` itself keeps its own.
GCS_RETRY_LIMIT_S = 15


def bounded_uri(uri: str) -> str:
    """``uri`` as handed to ``pyarrow.fs.FileSystem.from_uri``: a GCS URI gets
    ``retry_limit_seconds`` (``GCS_RETRY_LIMIT_S``) unless it has its own."""
    scheme = uri.partition("://")[0].lower()
    if scheme not in ("gs", "gcs") or "retry_limit_seconds=" in uri.partition("?")[2]:
        return uri
    return f"{uri}{'&' if '?' in uri else '?'}retry_limit_seconds={GCS_RETRY_LIMIT_S}"


def canonical_root(root: str) -> str:
    """The one spelling of ``root`` used for actor names and holder ids.

    Local paths are normalized (not resolved: symlinks may differ per node);
    URIs lose trailing slashes.
    """
    root = root.strip()
    if is_uri(root):
        scheme, _, rest = root.partition("://")
        rest = rest.rstrip("/") if rest.strip("/") else rest
        return f"{scheme.lower()}://{rest}"
    root = os.path.normpath(root)
    # POSIX keeps a leading "//" apart; Linux (and raykv) reads it as "/".
    return "/" + root.lstrip("/") if root.startswith("//") else root


def root_problem_here(root: str) -> str | None:
    """What makes a local ``root`` unusable as seen from this process (a
    regular file where the root directory should be), else None. A missing
    root is fine: the root actor creates it (and says so if it cannot)."""
    if is_uri(root) or not os.path.lexists(root) or os.path.isdir(root):
        return None
    return f"{root!r} exists but is not a directory"


#: Longest ``root`` accepted: block paths add ~290 characters under it and
#: PATH_MAX is 4096 (a longer root is a mistake, not a layout).
MAX_ROOT_CHARS = 1024
#: Directories that are never a cache root themselves: the file system's
#: top, and folders shared by everything on a machine (a root goes inside one).
SYSTEM_ROOTS = frozenset(
    (
        "/",
        "/home",
        "/root",
        "/tmp",
        "/var",
        "/var/tmp",
        "/var/lib",
        "/mnt",
        "/media",
        "/opt",
        "/srv",
        "/run",
        "/dev/shm",
    )
)
#: Trees no cache root may be inside: the OS, its configuration and kernel interfaces
#: (``/dev/shm/...`` is fine: RAM-backed storage).
SYSTEM_TREES = (
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr",
)


def system_dir_problem(path: str) -> str | None:
    """Why the local ``path`` (after ``..`` and ``//`` are resolved lexically) is
    no place for block files, else None."""
    norm = canonical_root(path)
    if norm in SYSTEM_ROOTS:
        inside = f"{norm.rstrip('/')}/raykv"
        return f"{path!r} is the system directory {norm!r}; use a folder of its own inside it (e.g. {inside})"
    for tree in SYSTEM_TREES:
        if (norm == tree or norm.startswith(tree + "/")) and not norm.startswith("/dev/shm/"):
            return (
                f"{path!r} is inside the system directory {tree!r} ({norm!r}); "
                "use shared storage or a folder of its own (e.g. /mnt/kv, /dev/shm/raykv)"
            )
    return None


def check_root(value: str) -> str | None:
    """``opt(check=...)`` for the ``root`` option."""
    if not isinstance(value, str) or not value.strip():
        return "must be a non-empty path or URI"
    if "\x00" in value:
        return "must not contain NUL bytes"
    if len(value) > MAX_ROOT_CHARS:
        return f"must be at most {MAX_ROOT_CHARS} characters; got {len(value)} ({value[:40]!r}...)"
    if is_uri(value):
        scheme = value.split("://", 1)[0]
        if not scheme or not all(c.isalnum() or c in "+-." for c in scheme):
            return f"bad URI scheme in {value!r}"
        if not value.split("://", 1)[1].strip("/"):
            return f"URI {value!r} names no bucket or path"
        return None
    if not os.path.isabs(value):
        return (
            f"must be an absolute path (on shared storage every node must resolve it the same) "
            f"or a pyarrow.fs URI such as s3://bucket/prefix; got {value!r}"
        )
    return system_dir_problem(value)


@dataclass(frozen=True)
class FileEntry:
    key: bytes
    size: int
    mtime: float


class Storage(ABC):
    """Block files under one root."""

    local: bool = False

    def __init__(self, root: str, algo: int = fmt.ALGORITHMS["crc32"]) -> None:
        self.root = root
        self.algo = algo  # checksum algorithm of the files this process writes
        self._dirs_lock = threading.Lock()
        self._known_dirs: set[str] = set()
        self._scan_removed: dict[str, list[Removal]] = {}
        #: This process's folder of unfinished stores (``fmt.TMP_DIR``), made on its first store.
        self.tmp_dir = f"{self.root}/{fmt.TMP_DIR}/{uuid.uuid4().hex[:16]}"

    def _made(self, parent: str, path: str) -> str:
        """Folder ``path`` (in ``parent``, both below the root), made owner-only unless this
        process made or saw it already."""
        if path not in self._known_dirs:
            self._make_dirs(parent, path)
            with self._dirs_lock:
                self._known_dirs.add(path)
        return path

    @abstractmethod
    def _make_dirs(self, parent: str, path: str) -> None:
        """Make ``parent``, then ``path`` in it, where missing."""

    def _tmp_dir(self) -> str:
        """This writer's temp folder, made (with ``fmt.TMP_DIR``) when missing."""
        return self._made(os.path.dirname(self.tmp_dir), self.tmp_dir)

    def _forget_dirs(self, *dirs: str) -> None:
        """Folders found gone: the next store makes them again."""
        with self._dirs_lock:
            self._known_dirs.difference_update(dirs)

    def note_scan_removal(self, reason: str, path: str, key: bytes | None, detail: str) -> None:
        """A block file ``scan`` removed (``scan_removals``)."""
        from raykv.metrics.incidents import Removal

        self._scan_removed.setdefault(reason, []).append(Removal(key.hex() if key else "?", path, detail[:200]))

    def scan_removals(self) -> dict[str, list[Removal]]:
        """Block files the last ``scan`` removed, by reason
        (``raykv.metrics.incidents.Removal``s); cleared by the call."""
        out, self._scan_removed = self._scan_removed, {}
        return out

    @abstractmethod
    def ensure_root(self) -> None:
        """Create the root if missing (owner-only on local paths)."""

    @abstractmethod
    def existing_size(self, key: bytes) -> int | None:
        """Size of ``key``'s block file, or None when there is none."""

    @abstractmethod
    def store(self, key: bytes, payload: memoryview, fsync: bool) -> int:
        """Write ``key``'s block atomically (durably with ``fsync``); returns the file size."""

    @abstractmethod
    def load(self, key: bytes, payload: memoryview) -> int:
        """Read and verify ``key``'s block into ``payload``; returns bytes read."""

    @abstractmethod
    def remove_file(self, path: str) -> None:
        """Delete one file (``FileNotFoundError`` when it is not there)."""

    def delete(self, keys: Iterable[bytes]) -> int:
        """Delete the keys' files (missing ones are fine); count deleted."""
        n = 0
        for key in keys:
            try:
                self.remove_file(self.path_of(key))
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("cannot delete block file of %s: %r", key.hex()[:16], e)
        return n

    @abstractmethod
    def scan(self, tmp_max_age_s: float = 3600.0) -> list[FileEntry]:
        """Every block file under the root (stale temp files are removed)."""

    def delete_path(self, path: str) -> None:
        """Delete one file by path (scan clean-up); errors are ignored."""
        try:
            self.remove_file(path)
        except OSError:
            pass

    @abstractmethod
    def read_key(self, path: str) -> bytes:
        """The key in a block file's header."""

    @abstractmethod
    def sweep_tmp(self, max_age_s: float) -> list[str]:
        """Remove writers' temp files (``fmt.TMP_DIR``) older than ``max_age_s`` (a writer
        killed mid-store), and writers' folders left empty that long; returns the files' paths."""

    def path_of(self, key: bytes) -> str:
        return f"{self.root}/{fmt.rel_path(key)}"


def _tmp_name(key: bytes) -> str:
    return f".{fmt.file_name(key)}.{uuid.uuid4().hex[:16]}{fmt.TMP_SUFFIX}"


# ---------------------------------------------------------------------------
class LocalStorage(Storage):
    """A POSIX directory: plain os calls, no copy beyond the one into or out of the caller's buffer."""

    local = True

    def __init__(self, root: str, algo: int = fmt.ALGORITHMS["crc32"]) -> None:
        super().__init__(os.path.normpath(root), algo)

    def ensure_root(self) -> None:
        """Create the root itself, never its parents: a missing parent usually
        means the shared filesystem is not mounted, and blocks must not land
        on a local disk by accident."""
        if os.path.isdir(self.root):
            return
        if os.path.lexists(self.root):
            raise NotADirectoryError(f"fs tier root {self.root!r} exists but is not a directory")
        parent = os.path.dirname(self.root)
        if not os.path.isdir(parent):
            raise FileNotFoundError(
                f"fs tier root {self.root!r}: its parent directory {parent!r} does not exist "
                "(is the shared filesystem mounted on this node?)"
            )
        try:
            os.mkdir(self.root, DIR_MODE)
        except FileExistsError:  # created meanwhile: by another node's actor, or as a file
            if not os.path.isdir(self.root):
                raise NotADirectoryError(f"fs tier root {self.root!r} exists but is not a directory") from None

    def _dir(self, key: bytes) -> str:
        rel = fmt.rel_dir(key)
        return self._made(os.path.join(self.root, rel.split("/", 1)[0]), os.path.join(self.root, rel))

    def _make_dirs(self, parent: str, path: str) -> None:
        _mkdirs_owner_only(parent, path)

    def existing_size(self, key: bytes) -> int | None:
        try:
            st = os.stat(self.path_of(key))
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def store(self, key: bytes, payload: memoryview, fsync: bool) -> int:
        header = fmt.encode_header(key, payload, self.algo)
        d = self._dir(key)
        tmp = os.path.join(self._tmp_dir(), _tmp_name(key))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        try:
            fd = os.open(tmp, flags, FILE_MODE)
        except FileNotFoundError:  # our cached folder vanished (swept while idle): recreate once
            self._forget_dirs(self.tmp_dir)
            tmp = os.path.join(self._tmp_dir(), os.path.basename(tmp))
            fd = os.open(tmp, flags, FILE_MODE)
        try:
            try:
                _pwritev_all(fd, [header, payload])
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            final = os.path.join(d, fmt.file_name(key))
            try:
                os.rename(tmp, final)
            except FileNotFoundError:  # the block's cached folder vanished: recreate once
                self._forget_dirs(d)
                d = self._dir(key)
                os.rename(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if fsync:  # the rename itself (concurrent fsyncs share journal commits)
            _fsync_dir(d)
        return len(header) + len(payload)

    def load(self, key: bytes, payload: memoryview) -> int:
        hlen = fmt.header_size(len(key))
        head = bytearray(hlen)
        spare = bytearray(1)
        fd = os.open(self.path_of(key), os.O_RDONLY | _O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size != hlen + len(payload):  # checked before touching the slot
                raise fmt.FormatError(f"file length {size} != {hlen + len(payload)} (truncated or overlong)")
            n = _preadv_all(fd, [head, payload, spare])
        finally:
            os.close(fd)
        fmt.verify(memoryview(head)[: min(n, hlen)], key, payload, n)
        return n

    def remove_file(self, path: str) -> None:
        os.unlink(path)

    def scan(self, tmp_max_age_s: float = 3600.0) -> list[FileEntry]:
        out: list[FileEntry] = []
        now = time.time()
        if not os.path.isdir(self.root):
            return out
        legacy = _subdirs(self.root, fmt.is_legacy_dir)
        if legacy:  # blocks written before identity scoping: never served again
            logger.warning(
                "fs root %s has %d fan-out folders of unscoped blocks from an older raykv; they are "
                "ignored and can be deleted (rm -r %s/??)",
                self.root,
                len(legacy),
                self.root,
            )
        for l1 in _subdirs(self.root, fmt.is_identity_dir):
            for l2 in _subdirs(l1, fmt.is_fan_dir):
                with os.scandir(l2) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                            if stat.S_ISREG(st.st_mode):
                                _scan_entry(self, e.name, e.path, st.st_size, st.st_mtime, now, tmp_max_age_s, out)
                        except OSError as err:
                            logger.warning("scan: skipping %s: %r", e.path, err)
        return out

    def read_key(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return fmt.decode_header(f.read(fmt.FIXED_SIZE + fmt.MAX_KEY_BYTES)).key

    def sweep_tmp(self, max_age_s: float) -> list[str]:
        return _sweep_tmp_dirs(os.path.join(self.root, fmt.TMP_DIR), self.tmp_dir, max_age_s)


def _mkdirs_owner_only(*dirs: str) -> None:
    """Make each folder owner-only where missing, in order (never the root itself)."""
    for d in dirs:
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            pass


def _sweep_tmp_dirs(tmp_root: str, own: str, max_age_s: float) -> list[str]:
    """``Storage.sweep_tmp`` on a POSIX folder ``tmp_root`` of writers' folders (``own``: this process's)."""
    removed: list[str] = []
    if not os.path.isdir(tmp_root):  # no writer has stored yet
        return removed
    now = time.time()
    for writer in _subdirs(tmp_root, lambda _: True):
        try:
            with os.scandir(writer) as it:
                entries = list(it)
            for e in entries:
                if fmt.is_tmp_name(e.name) and now - e.stat(follow_symlinks=False).st_mtime > max_age_s:
                    os.unlink(e.path)
                    removed.append(e.path)
            if writer != own and now - os.stat(writer).st_mtime > max_age_s:
                os.rmdir(writer)  # a writer gone this long; one that is not makes it again
        except OSError:  # gone meanwhile, not empty, or unreadable: the next sweep looks again
            continue
    return removed


def _subdirs(path: str, wanted: Callable[[str], bool]) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if wanted(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError as e:
        logger.warning("scan: cannot list %s: %r", path, e)
        return []


def _scan_entry(
    storage, name: str, path: str, size: int, mtime: float, now: float, tmp_max_age_s: float, out: list
) -> None:
    if fmt.is_tmp_name(name):
        if now - mtime > tmp_max_age_s:  # a writer that died mid-write
            storage.delete_path(path)
            storage.note_scan_removal("stale_tmp", path, None, f"temp file older than {tmp_max_age_s:g} s")
        return
    key = fmt.key_from_name(name)
    if key is None and fmt.is_hashed_name(name):
        try:
            key = storage.read_key(path)
        except (OSError, ValueError) as e:
            storage.delete_path(path)
            storage.note_scan_removal("unreadable", path, None, repr(e))
            return
        if fmt.file_name(key) != name:
            storage.delete_path(path)
            storage.note_scan_removal("misnamed", path, key, f"its header names another key, file {name}")
            return
    if key is None:
        return
    out.append(FileEntry(key, size, mtime))


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (what one vectored call moved)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def _pwritev_all(fd: int, bufs: list) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    offset = 0
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(f"pwritev wrote {n} bytes")
        offset += n
        _advance(views, n)


def _preadv_all(fd: int, bufs: list) -> int:
    """Fill ``bufs`` from offset 0 until they are full or the file ends."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = 0
    while views:
        n = os.preadv(fd, views, total)
        if n == 0:
            break
        total += n
        _advance(views, n)
    return total


# ---------------------------------------------------------------------------
class ArrowStorage(Storage):
    """A ``pyarrow.fs`` filesystem (any of them), addressed by URI."""

    ATOMIC_PUT = ("s3", "gcs")  # a single object put is atomic

    def __init__(
        self, root: str, algo: int = fmt.ALGORITHMS["crc32"], filesystem: pafs.FileSystem | None = None
    ) -> None:
        """``root``: a URI; or, with ``filesystem`` (a ``pyarrow.fs.FileSystem``), a path in it."""
        import pyarrow.fs as pafs

        self._pafs = pafs
        if filesystem is None:
            self.fs, base = pafs.FileSystem.from_uri(bounded_uri(root))
        else:
            self.fs, base = filesystem, root
        super().__init__(base.rstrip("/") or base, algo)
        self.uri = root
        self.type_name = self.fs.type_name
        self.atomic_put = self.type_name in self.ATOMIC_PUT
        self.posix_backed = self.type_name == "local"

    def ensure_root(self) -> None:
        if self.atomic_put:
            return  # object stores have no directories
        info = self.fs.get_file_info(self.root)
        if info.type == self._pafs.FileType.NotFound:
            self.fs.create_dir(self.root, recursive=True)
            if self.posix_backed:
                os.chmod(self.root, DIR_MODE)
        elif info.type != self._pafs.FileType.Directory:
            raise NotADirectoryError(f"fs tier root {self.uri!r} exists but is not a directory")

    def _dir(self, key: bytes) -> str:
        rel = fmt.rel_dir(key)
        path = f"{self.root}/{rel}"
        if self.atomic_put:  # object stores have no folders (and their puts need no temp file)
            return path
        return self._made(f"{self.root}/{rel.split('/', 1)[0]}", path)

    def _make_dirs(self, parent: str, path: str) -> None:
        if self.posix_backed:
            _mkdirs_owner_only(parent, path)
        else:
            self.fs.create_dir(path, recursive=True)

    def existing_size(self, key: bytes) -> int | None:
        info = self.fs.get_file_info(self.path_of(key))
        return info.size if info.type == self._pafs.FileType.File else None

    def store(self, key: bytes, payload: memoryview, fsync: bool) -> int:
        header = fmt.encode_header(key, payload, self.algo)
        d = self._dir(key)
        final = f"{d}/{fmt.file_name(key)}"
        target = final if self.atomic_put else f"{self._tmp_dir()}/{_tmp_name(key)}"
        try:
            try:
                out = self.fs.open_output_stream(target)
            except FileNotFoundError:  # our temp folder was swept while we were idle: make it again
                if target == final:
                    raise
                self._forget_dirs(self.tmp_dir)
                target = f"{self._tmp_dir()}/{os.path.basename(target)}"
                out = self.fs.open_output_stream(target)
            with out:
                out.write(header)
                out.write(payload)
            if self.posix_backed:
                os.chmod(target, FILE_MODE)
                if fsync:
                    fd = os.open(target, os.O_RDONLY | _O_CLOEXEC)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            if target != final:
                self.fs.move(target, final)
                if fsync and self.posix_backed:
                    _fsync_dir(d)
        except BaseException:
            if target != final:
                try:
                    self.fs.delete_file(target)
                except Exception:
                    pass
            raise
        return len(header) + len(payload)

    def load(self, key: bytes, payload: memoryview) -> int:
        hlen = fmt.header_size(len(key))
        with self.fs.open_input_file(self.path_of(key)) as f:
            size = f.size()
            head = f.read(min(hlen, size))
            if size != hlen + len(payload):  # checked before touching the slot
                raise fmt.FormatError(f"file length {size} != {hlen + len(payload)} (truncated or overlong)")
            n = f.readinto(payload)
        if n != len(payload):
            raise fmt.FormatError(f"short read: {n} of {len(payload)} payload bytes")
        fmt.verify(head, key, payload, size)
        return size

    def remove_file(self, path: str) -> None:
        self.fs.delete_file(path)

    def read_key(self, path: str) -> bytes:
        with self.fs.open_input_file(path) as f:
            return fmt.decode_header(f.read(min(f.size(), fmt.FIXED_SIZE + fmt.MAX_KEY_BYTES))).key

    def sweep_tmp(self, max_age_s: float) -> list[str]:
        if self.atomic_put:
            return []
        if self.posix_backed:
            return _sweep_tmp_dirs(f"{self.root}/{fmt.TMP_DIR}", self.tmp_dir, max_age_s)
        removed: list[str] = []
        now = time.time()
        sel = self._pafs.FileSelector(f"{self.root}/{fmt.TMP_DIR}", recursive=True, allow_not_found=True)
        try:
            infos = self.fs.get_file_info(sel)
        except OSError:
            return removed
        for info in infos:
            mtime = info.mtime_ns / 1e9 if info.mtime_ns is not None else now
            if info.type == self._pafs.FileType.File and fmt.is_tmp_name(info.base_name) and now - mtime > max_age_s:
                try:
                    self.fs.delete_file(info.path)
                    removed.append(info.path)
                except OSError:
                    continue
        return removed

    def scan(self, tmp_max_age_s: float = 3600.0) -> list[FileEntry]:
        out: list[FileEntry] = []
        now = time.time()
        sel = self._pafs.FileSelector(self.root, recursive=True, allow_not_found=True)
        for info in self.fs.get_file_info(sel):
            if info.type != self._pafs.FileType.File:
                continue
            mtime = info.mtime_ns / 1e9 if info.mtime_ns is not None else now
            try:
                _scan_entry(self, info.base_name, info.path, info.size, mtime, now, tmp_max_age_s, out)
            except OSError as err:
                logger.warning("scan: skipping %s: %r", info.path, err)
        return out


def open_storage(root: str, algo: int = fmt.ALGORITHMS["crc32"]) -> Storage:
    """The storage for a canonical root: os calls for paths, pyarrow.fs for URIs."""
    return ArrowStorage(root, algo) if is_uri(root) else LocalStorage(root, algo)

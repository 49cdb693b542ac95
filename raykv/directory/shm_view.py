"""A node's directory view in shared memory: written by its agent, read by its engines.

Files in ``/dev/shm`` (Linux's tmpfs), per namespace and node:

- ``raykv_view_<digest>``: a header (9 little-endian uint64: magic, seqlock
  sequence, table generation, buckets, decode-table version, decode-table
  length, writer pid, the writer's last heartbeat in ns since the epoch, and 1
  when the view is complete: a key it does not list is held by nobody) and, after
  ``HEADER_BYTES``, the decode table: a pickle of (slot -> ``HolderInfo``,
  per set id its slots);
- ``raykv_view_<digest>.<generation>``: the ``FingerprintTable``'s arrays
  (fingerprints, then values). A table that grows gets a new generation; the
  old file is unlinked at once (readers that mapped it keep a valid copy until
  they see the new generation).

Readers take no lock. The writer makes the sequence odd before a change and
even after it; a reader that saw an odd sequence, or a different one after
reading, reads again (a seqlock), and after a few tries asks the agent
instead. This relies on stores becoming visible in program order (x86's TSO;
checked on x86-64 only). A torn read can at worst name a holder that does not
hold the key: holders look blocks up by the whole key, so that load fails and
vLLM recomputes; it never serves other bytes.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pickle
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from raykv.core.logs import Throttled
from raykv.core.wire import HolderInfo
from raykv.directory.fingerprint import fingerprint, fingerprints
from raykv.directory.fptable import BUCKET, FingerprintTable
from raykv.directory.view import NodeView

SHM_DIR = "/dev/shm"
PREFIX = "raykv_view_"
MAGIC = 0x5241594B56564945  # "RAYKVVIE"
HEADER_BYTES = 4096
#: Room for the decode table (holders and sets: a few KiB on real clusters).
DECODE_BYTES = 8 << 20
_MAGIC, _SEQ, _GEN, _BUCKETS, _VERSION, _LENGTH, _PID, _ALIVE_NS, _COMPLETE = range(9)
#: A view whose writer has not beaten for this long is not read (its agent is gone).
STALE_NS = 5_000_000_000
#: How often a reader without a view looks for one (an open() that fails).
ATTACH_EVERY_S = 0.2
#: Most keys whose fingerprints a reader remembers (an engine looks the same prefixes
#: up step after step; hashing them again cost more than the read itself).
FP_CACHE_KEYS = 262_144
#: Reads tried at once before a reader gives up on this round (the writer is mid-change).
READ_TRIES = 4
#: Then, while the writer is still mid-change, the reader naps and tries again for up to this
#: long: a writer descheduled mid-change on a busy host lasts longer than four tries. Giving up
#: costs the engine a call to the agent, the writer's own process, and a wait of up to
#: ``lookup_wait_ms`` (5 ms by default) that ends in a RETRY when that process is still
#: descheduled: a wait as long costs no more. 200 us was too short: a 2-core host running vLLM
#: deschedules the agent for milliseconds.
READ_WAIT_NS = 5_000_000
#: How long a waiting reader sleeps between tries. A sleep, not ``sched_yield``: a reader that
#: yields stays runnable and keeps its core, so on a host with every core busy the descheduled
#: writer it waits for finds no core free (``raykv bench view-reads``, 2 cores all busy: 58.7
#: reads per 1,000 given up with yields, 0.13 with naps; p99 6.5 ms against 1.1 ms).
READ_NAP_S = 50e-6
#: Why a read was given up (``ViewReader.gave_up``'s keys), in words for the warning.
_WHY = {
    "stale": "its agent has not beaten for 5 s",
    "busy": "its agent was mid-change for longer than a reader waits: a busy host?",
    "remap": "its table was replaced as it was read",
    "decode": "its holder table could not be read",
}
logger = logging.getLogger(__name__)
_unread = Throttled(logger)


def view_path(namespace: str, node_id: str, shm_dir: str = SHM_DIR) -> str:
    """The header file of ``node_id``'s view in ``namespace``."""
    digest = hashlib.sha256(f"{namespace}\0{node_id}".encode()).hexdigest()[:16]
    return os.path.join(shm_dir, PREFIX + digest)


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    """Map ``path``; ``create``: a new file of ``size`` bytes whose pages are all
    allocated now. A tmpfs that fills up (Docker's 64 MiB ``/dev/shm``, or a node's
    whose CPU primaries take it all) then fails here with ENOSPC, where a sparse file
    would kill its writer with SIGBUS at the first write to a page it has no room for."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC if create else os.O_RDONLY
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(path)
                raise
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | (mmap.PROT_WRITE if create else 0))
    finally:
        os.close(fd)


def _retire(path: str) -> None:
    """Mark the view at ``path`` (an earlier life's, if any) as not written any more:
    its readers look for the new file at once instead of after ``STALE_NS``."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        if os.fstat(fd).st_size >= HEADER_BYTES:
            with mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED) as mm:
                struct.pack_into("<Q", mm, _ALIVE_NS * 8, 0)
    finally:
        os.close(fd)


def _shm_space(folder: str) -> str:
    try:
        st = os.statvfs(folder)
    except OSError:
        return "its free space unknown"
    mib = 1 << 20
    return f"{st.f_bavail * st.f_frsize / mib:.0f} MiB free of {st.f_blocks * st.f_frsize / mib:.0f} MiB"


def _table_arrays(mm: mmap.mmap, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    n = buckets * BUCKET
    fps = np.frombuffer(mm, dtype=np.uint64, count=n).reshape(buckets, BUCKET)
    vals = np.frombuffer(mm, dtype=np.uint32, count=n, offset=n * 8).reshape(buckets, BUCKET)
    return fps, vals


class ViewWriter:
    """The agent's side: owns the files; ``allocate`` and ``changing`` plug into ``NodeView``.

    Where ``/dev/shm`` has no room for the view (at start, or for a larger table as it
    grows), the writer stops publishing it (``published`` False, one warning): it
    removes its files and keeps the view in its own memory, engines on the node ask
    the agent for every lookup (a call each, as with ``directory_agent: false``'s
    shards), and nothing else changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        #: Unique across the agent's lives: a reader never takes a new life's table for its old one.
        self.generation = int.from_bytes(os.urandom(4), "little") << 24
        self._table_gen = 0  # the generation readers are sent to (0: none yet)
        #: A table ``allocate`` made that readers are not sent to yet: generation, buckets, map.
        self._next_table: tuple[int, int, mmap.mmap] | None = None
        self._remove_old_tables()  # (before mapping: their room is ours again)
        #: Whether engines can read the view in ``/dev/shm`` (False once it had no room).
        self.published = True
        size = HEADER_BYTES + DECODE_BYTES
        # A new file renamed over the last life's: readers that mapped that one never see it
        # truncated (SIGBUS), only stale, and then map this one (``ViewReader``).
        new = f"{path}.new-{os.getpid()}"
        try:
            self._header = _map(new, size, create=True)
            _retire(path)
            os.rename(new, path)
        except OSError as e:
            self._unlink(new)
            self._header = mmap.mmap(-1, size)  # the agent's own memory: not /dev/shm's
            self._stop_publishing(e)
        self._hdr = np.frombuffer(self._header, dtype=np.uint64, count=9)
        self._hdr[_PID] = os.getpid()
        self._hdr[_MAGIC] = MAGIC
        self._table: mmap.mmap | None = None
        self._depth = 0
        #: Called as the outermost change ends, before readers may read (publish the decode table).
        self.before_end: Callable[[], None] | None = None
        self.beat()
        self.decode_version = -1
        #: What the header says of the decode table: unique across lives (a reader
        #: must never decode a new life's set ids with an old life's table).
        self._decode_stamp = int.from_bytes(os.urandom(6), "little") << 16
        self.decode_too_big = False

    def allocate(self, buckets: int) -> tuple[np.ndarray, np.ndarray]:
        """A new generation's zeroed arrays (``FingerprintTable``'s allocator). Readers
        keep reading the current one while the new one is filled: they are sent to it
        as the next change ends (``changing``), a rebuild then costs them no wait."""
        self.generation += 1
        path = f"{self.path}.{self.generation}"
        mm: mmap.mmap | None = None
        if self.published:
            try:
                mm = _map(path, buckets * BUCKET * 12, create=True)
            except OSError as e:
                self._stop_publishing(e)
        if mm is None:
            mm = mmap.mmap(-1, buckets * BUCKET * 12)  # the agent's own memory
        if self._next_table is not None:  # allocated and replaced before it was ever shown
            self._unlink(f"{self.path}.{self._next_table[0]}")
        self._next_table = (self.generation, buckets, mm)
        return _table_arrays(mm, buckets)

    def _show_next_table(self) -> int:
        """Send readers to the table ``allocate`` made last (inside a change); returns the
        generation they no longer read (0: none), whose file is to go."""
        assert self._next_table is not None
        generation, buckets, mm = self._next_table
        self._next_table = None
        self._hdr[_BUCKETS] = buckets
        self._hdr[_GEN] = generation
        old, self._table_gen = self._table_gen, generation
        self._table = mm  # the arrays keep the old map alive while they live
        return old

    @contextmanager
    def changing(self) -> Iterator[None]:
        """Bracket a change (nestable): readers retry while it lasts."""
        self._depth += 1
        if self._depth == 1:
            self._hdr[_SEQ] += 1
        try:
            yield
        finally:
            shown = 0
            if self._depth == 1:
                if self.before_end is not None:
                    self.before_end()
                if self._next_table is not None:
                    shown = self._show_next_table()
            self._depth -= 1
            if self._depth == 0:
                self._hdr[_SEQ] += 1
            if shown:  # (freeing a big table's pages takes a while: not while readers wait)
                self._unlink(f"{self.path}.{shown}")  # readers that mapped it keep their map

    def publish_from(
        self,
        version: Callable[[], int],
        decode_table: Callable[[], tuple[dict[int, HolderInfo], list[tuple[int, ...]]]],
    ) -> None:
        """Publish ``decode_table()`` (holders, sets) as each change that moved ``version()``
        ends, and once now: until a first table is out, readers could decode no entry and
        gave every read up. (Built only when the version moved: a change holds readers off.)"""

        def publish() -> None:
            v = version()
            if v != self.decode_version:
                self.publish_decode(v, *decode_table())

        self.before_end = publish
        with self.changing():
            pass

    def set_complete(self, complete: bool) -> None:
        """Whether readers may take a key the view does not list as held by nobody."""
        if bool(self._hdr[_COMPLETE]) != complete:
            with self.changing():
                self._hdr[_COMPLETE] = int(complete)

    def beat(self) -> None:
        """Tell readers the writer lives (the agent calls it at least every second)."""
        if self.published:
            self._hdr[_ALIVE_NS] = time.time_ns()

    def _stop_publishing(self, error: OSError) -> None:
        """No room in ``/dev/shm``: readers that mapped the view see it stale and ask the
        agent; its files go (the maps keep their pages while mapped)."""
        folder = os.path.dirname(self.path)
        logger.warning(
            "directory view not in shared memory (%s: %s, %s): engines on this node ask the "
            "directory agent for every lookup, a call each; give %s more room (a container's "
            "--shm-size) or lower agent_view_keys",
            folder,
            error.strerror or error,
            _shm_space(folder),
            folder,
        )
        self.published = False
        if hasattr(self, "_hdr"):
            self._hdr[_ALIVE_NS] = 0
        self.close()

    def _remove_old_tables(self) -> None:
        """Tables an earlier life of the agent left (a crash unlinks nothing)."""
        folder, name = os.path.split(self.path)
        for entry in os.listdir(folder):
            if entry.startswith(name + "."):
                self._unlink(os.path.join(folder, entry))

    def publish_decode(self, version: int, holders: dict[int, HolderInfo], sets: list[tuple[int, ...]]) -> None:
        """Write the decode table when ``version`` changed (before any entry uses it)."""
        if version == self.decode_version:
            return
        blob = pickle.dumps((holders, sets), protocol=pickle.HIGHEST_PROTOCOL)
        if len(blob) > DECODE_BYTES:  # readers then fall back to asking the agent
            self.decode_too_big = True
            return
        with self.changing():
            self._header[HEADER_BYTES : HEADER_BYTES + len(blob)] = blob
            self._hdr[_LENGTH] = len(blob)
            self._decode_stamp += 1
            self._hdr[_VERSION] = self._decode_stamp & 0xFFFF_FFFF_FFFF_FFFF
        self.decode_version = version

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Remove the files (readers fall back to asking the agent)."""
        for generation in {self._table_gen, self.generation}:
            self._unlink(f"{self.path}.{generation}")
        self._unlink(self.path)


def published_view(path: str, node_id: str, max_keys: int, all_keys: bool) -> tuple[ViewWriter, NodeView]:
    """A node view whose every change is published at ``path`` by its writer (the agent's)."""
    writer = ViewWriter(path)
    view = NodeView(
        node_id,
        max_keys,
        allocate=writer.allocate,
        changing=writer.changing,
        all_keys=all_keys,
        on_complete=writer.set_complete,
    )
    writer.publish_from(lambda: view.version, view.decode_table)
    return writer, view


class ViewReader:
    """An engine's side: answers keys from the node's view, or says it cannot.

    Every answer is the view at one instant; a key the view does not know (or
    a read that kept colliding with the writer) answers None: ask the agent.
    """

    def __init__(self, path: str, nap_s: float = READ_NAP_S) -> None:
        self.path = path
        #: Sleep between tries while the writer is mid-change (0: ``sched_yield`` instead,
        #: the baseline of ``raykv bench view-reads``).
        self.nap_s = nap_s
        self._header: mmap.mmap | None = None
        self._hdr: memoryview | None = None
        self._gen = 0
        self._table: FingerprintTable | None = None
        self._flat_fps: memoryview | None = None
        self._flat_vals: memoryview | None = None
        self._mask = 0
        self._decode_version = -1
        self._by_set: list[list[HolderInfo]] = []
        self._next_try = 0.0
        self._ino = 0  # the mapped header file's inode
        #: Whether the last read's view was complete (an unlisted key: held by nobody).
        self._complete = False
        self.reads = 0
        self.retries = 0
        self._busy = False  # the last read found the writer mid-change
        self._why = ""  # why the last _begin could not read
        #: Reads given up, per reason (``_WHY``); with no view at all: ``no view``.
        self.gave_up: Counter[str] = Counter()
        #: Why the last read was given up (a ``gave_up`` key); None: it held.
        self.unread: str | None = None
        self._given_up_seq = -1  # the mid-change sequence a read waited out in vain
        self._fps: dict[bytes, int] = {}

    def _attach(self) -> bool:
        if self._hdr is not None:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + ATTACH_EVERY_S  # no view (yet): look again soon
        try:
            ino = os.stat(self.path).st_ino
            mm = _map(self.path, HEADER_BYTES + DECODE_BYTES, create=False)
        except (FileNotFoundError, ValueError, OSError):
            return False
        hdr = memoryview(mm).cast("B").cast("Q")
        if hdr[_MAGIC] != MAGIC:
            return False
        self._header, self._hdr, self._ino = mm, hdr, ino
        return True

    def _look_for_a_new_file(self) -> None:
        """A stale view's file may have been replaced: a writer that had no room in
        ``/dev/shm`` removed it, and its agent's next life made a new one. Checked at
        most every ``ATTACH_EVERY_S``; a new file is mapped by the next read."""
        now = time.monotonic()
        if now < self._next_try:
            return
        self._next_try = now + ATTACH_EVERY_S
        try:
            replaced = os.stat(self.path).st_ino != self._ino
        except OSError:
            return  # none: keep the stale one (it says why reads are given up)
        if replaced:
            self._header = self._hdr = None  # its maps go once no array of it is left
            self._table = self._flat_fps = self._flat_vals = None
            self._gen, self._decode_version, self._next_try = 0, -1, 0.0

    def _remap(self, gen: int, buckets: int) -> bool:
        try:
            mm = _map(f"{self.path}.{gen}", buckets * BUCKET * 12, create=False)
        except (FileNotFoundError, ValueError, OSError):
            return False  # replaced again meanwhile: the next read finds the newer one
        fps, vals = _table_arrays(mm, buckets)
        self._table = FingerprintTable.over(fps, vals)
        self._flat_fps = memoryview(mm).cast("B")[: buckets * BUCKET * 8].cast("Q")
        self._flat_vals = memoryview(mm).cast("B")[buckets * BUCKET * 8 :].cast("I")
        self._mask, self._gen = buckets - 1, gen
        return True

    def _decode(self, version: int) -> bool:
        assert self._header is not None and self._hdr is not None
        length = self._hdr[_LENGTH]
        if not length:
            return False
        try:
            holders, sets = pickle.loads(self._header[HEADER_BYTES : HEADER_BYTES + length])
        except Exception:  # torn by a change: the sequence check sends us round again
            return False
        self._by_set = [[holders[s] for s in slots] for slots in sets]
        self._decode_version = version
        return True

    def _begin(self) -> int | None:
        """The sequence to check against, with table and decode table current (None: not
        now, and ``_why`` says why: set on the failed paths only, off the read's hot path)."""
        self._busy = False
        if not self._attach():
            self._why = "no view"
            return None
        hdr = self._hdr
        assert hdr is not None
        if time.time_ns() - hdr[_ALIVE_NS] > STALE_NS:  # (a writer that died mid-change, too)
            self._why = "stale"
            self._look_for_a_new_file()
            return None
        seq = hdr[_SEQ]
        self._busy = bool(seq & 1)
        if self._busy:
            self._why = "busy"
            return None
        if not hdr[_GEN]:  # the writer has not shown a table yet
            self._why = "no view"
            return None
        if hdr[_GEN] != self._gen and not self._remap(hdr[_GEN], hdr[_BUCKETS]):
            self._why = "remap"
            return None
        if hdr[_VERSION] != self._decode_version and not self._decode(hdr[_VERSION]):
            self._busy = hdr[_SEQ] != seq  # torn by a change begun meanwhile: wait it out
            self._why = "busy" if self._busy else "decode"
            return None
        self._complete = bool(hdr[_COMPLETE])
        return seq

    def _reads(self) -> Iterator[int]:
        """The sequence each read checks against; the caller returns once its read holds,
        and asks for the next when the writer changed the view meanwhile. ``READ_TRIES``
        at once, then, while the writer is mid-change, napping ``READ_NAP_S`` until ``READ_WAIT_NS``."""
        since = time.perf_counter_ns()
        attempt = 0
        self.unread = None
        while True:
            seq = self._begin()
            if seq is not None:
                yield seq
                self._busy, self._why = True, "busy"  # the caller's read was torn: the writer is mid-change
            elif self._why == "no view":  # no agent, or none that has shown a table, yet: not worth a warning
                self.gave_up["no view"] += 1
                self.unread = "no view"
                return
            self.retries += 1
            attempt += 1
            if attempt >= READ_TRIES:
                if not self._busy:
                    self._give_up()
                    return
                # A change already waited out in vain (a writer stuck mid-change) is not waited for again.
                assert self._hdr is not None  # (only a mapped view is found mid-change)
                seq_now = self._hdr[_SEQ]
                if seq_now == self._given_up_seq or time.perf_counter_ns() - since > READ_WAIT_NS:
                    self._given_up_seq = seq_now
                    self._give_up()
                    return
                if self.nap_s > 0:
                    time.sleep(self.nap_s)
                else:
                    os.sched_yield()

    def _give_up(self) -> None:
        """Count (and say, at most every 10 s per reason) a read the view could not answer."""
        self.gave_up[self._why] += 1
        self.unread = self._why
        _unread.warning(
            "raykv: the node's directory view %s could not be read (%s): this engine asks the node's agent instead",
            self.path,
            _WHY.get(self._why, self._why),
            key=self._why,
        )

    def _holders(self, set_id: int) -> list[HolderInfo] | None:
        return self._by_set[set_id] if set_id < len(self._by_set) else None

    def _fingerprints(self, keys: Sequence[bytes]) -> np.ndarray:
        """The keys' fingerprints, remembered (the cache is dropped whole when full)."""
        cache = self._fps
        got = [cache.get(k) for k in keys]
        missing = [i for i, f in enumerate(got) if f is None]
        if missing:
            if len(cache) + len(missing) > FP_CACHE_KEYS:
                cache.clear()
            for i, f in zip(missing, fingerprints([keys[i] for i in missing]).tolist()):
                got[i] = cache[keys[i]] = f
        return np.array(got, dtype=np.uint64)

    def get(self, key: bytes) -> list[HolderInfo] | None:
        """One key's holders from the view (None: not known there)."""
        fp = self._fps.get(key)
        if fp is None:
            fp = fingerprint(key)
            if len(self._fps) >= FP_CACHE_KEYS:
                self._fps.clear()
            self._fps[key] = fp
        for seq in self._reads():
            fps, vals, mask = self._flat_fps, self._flat_vals, self._mask
            assert fps is not None and vals is not None
            value = -1
            bucket = fp & mask
            for _ in range(mask + 1):
                base = bucket * BUCKET
                row = fps[base : base + BUCKET]
                for col in range(BUCKET):
                    f = row[col]
                    if f == fp:
                        value = vals[base + col]
                        break
                    if f == 0:
                        break
                else:
                    bucket = (bucket + 1) & mask
                    continue
                break
            assert self._hdr is not None
            if self._hdr[_SEQ] != seq:
                continue
            self.reads += 1
            if value < 0:
                return [] if self._complete else None
            return self._holders(value)
        return None

    def lookup(self, keys: Sequence[bytes]) -> list[list[HolderInfo] | None]:
        """Each key's holders from the view (None where not known there), in one read."""
        if not keys:
            return []
        fps = self._fingerprints(keys)
        for seq in self._reads():
            table = self._table
            assert table is not None and self._hdr is not None
            pos = table.find(fps)
            ids = np.where(pos >= 0, table.values[pos], 0)
            if self._hdr[_SEQ] != seq:
                continue
            self.reads += 1
            absent: list[HolderInfo] | None = [] if self._complete else None
            return [absent if p < 0 else self._holders(i) for p, i in zip(pos.tolist(), ids.tolist())]
        return [None] * len(keys)

    @property
    def complete(self) -> bool:
        """Whether the last read that held found the view complete (a key it does not
        list is held by nobody)."""
        return self._complete

    def alive_ns(self) -> int:
        """The writer's last heartbeat (ns since the epoch; 0: no view)."""
        return int(self._hdr[_ALIVE_NS]) if self._attach() and self._hdr is not None else 0

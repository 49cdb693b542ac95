"""A node's view in shared memory: the agent writes, engines read without a lock (no Ray)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from raykv.core.logs import Throttled
from raykv.core.wire import HolderInfo
from raykv.directory import shm_view
from raykv.directory.fingerprint import fingerprints, to_blob
from raykv.directory.shard import DirectoryShardImpl
from raykv.directory.shm_view import ViewReader, ViewWriter, view_path
from raykv.directory.view import NodeView

LOCAL = HolderInfo("local", "object_store", "PLASMA", "a", "ns", node_id="node-a")
REMOTE = HolderInfo("remote", "object_store", "PLASMA", "b", "ns", node_id="node-b")


@pytest.fixture
def shared(tmp_path):
    writer = ViewWriter(view_path("ns", "node-a", str(tmp_path)))
    view = NodeView("node-a", allocate=writer.allocate, changing=writer.changing)
    writer.publish_from(lambda: view.version, view.decode_table)
    yield writer, view, ViewReader(writer.path)
    writer.close()


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return [os.urandom(36) + salt.to_bytes(8, "little") for _ in range(n)]


def test_readers_see_what_the_agent_writes(shared):
    writer, view, reader = shared
    view.slot(0, LOCAL)
    keys = _keys(40)
    assert reader.lookup(keys) == [None] * 40  # nothing known yet: ask the agent
    view.register(0, "local", to_blob(fingerprints(keys[:30])))
    found = reader.lookup(keys)
    assert found[:30] == [[LOCAL]] * 30 and found[30:] == [None] * 10
    assert reader.get(keys[0]) == [LOCAL] and reader.get(keys[35]) is None


def test_known_nobody_is_an_answer_and_changes_follow(shared):
    _, view, reader = shared
    shard = DirectoryShardImpl(0, 1)
    shard.add_holder(REMOTE)
    keys = _keys(10)
    fps = fingerprints(keys)
    shard.register("remote", to_blob(fps[:5]))
    view.learn(0, fps, shard.lookup(to_blob(fps)))
    assert [h for h in reader.lookup(keys)] == [[REMOTE]] * 5 + [[]] * 5
    view.register(0, "remote", to_blob(fps[5:7]))  # the feed: a known key registered
    view.unregister(0, "remote", to_blob(fps[:1]))
    assert [len(h) for h in reader.lookup(keys)] == [0, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    view.drop_holder(0, "remote")
    assert [len(h) for h in reader.lookup(keys)] == [0] * 10


def test_a_growing_table_moves_to_a_new_file(shared, tmp_path):
    writer, view, reader = shared
    view.slot(0, LOCAL)
    first = writer.generation
    keys = _keys(5000)
    view.register(0, "local", to_blob(fingerprints(keys)))
    assert writer.generation > first
    tables = [p for p in os.listdir(tmp_path) if "." in p]
    assert tables == [os.path.basename(writer.path) + f".{writer.generation}"]  # old generations unlinked
    assert all(h == [LOCAL] for h in reader.lookup(keys))


def test_readers_read_the_old_table_while_a_new_one_is_filled(shared):
    """A growing view's rebuild (tens of ms for a million keys) is no change in progress:
    readers keep reading the current table meanwhile, then the new one, which is whole."""
    writer, view, reader = shared
    view.slot(0, LOCAL)
    keys = _keys(900)
    view.register(0, "local", to_blob(fingerprints(keys[:800])))
    allocate, during = writer.allocate, []

    def allocate_and_read(buckets: int):  # the rebuild begins: what does a reader get now?
        arrays = allocate(buckets)
        before = reader.retries
        during.append((reader.lookup(keys[:800]), reader.retries - before, dict(reader.gave_up)))
        return arrays

    view.table._allocate = allocate_and_read
    first = writer.generation
    view.register(0, "local", to_blob(fingerprints(keys[800:])))  # 900 keys: past the table's load
    assert writer.generation > first and len(during) == 1
    found, retries, gave_up = during[0]
    assert found == [[LOCAL]] * 800 and retries == 0 and not gave_up  # at once, from the old table
    assert reader.lookup(keys) == [[LOCAL]] * 900  # then the new one, every key in it


def test_reads_never_see_a_half_made_change(shared):
    """A writer moves keys between two holders, half by half but in one change;
    every read a reader completes sees all keys at one holder."""
    _, view, reader = shared
    view.slot(0, LOCAL)
    view.slot(0, REMOTE)
    keys = _keys(64)
    blob = to_blob(fingerprints(keys))
    view.register(0, "local", blob)
    stop = threading.Event()

    halves = [to_blob(fingerprints(keys[:32])), to_blob(fingerprints(keys[32:]))]

    def move(src: str, dst: str) -> None:
        with view.change():  # one change, made of four writes
            for half in halves:
                view.register(0, dst, half)
                view.unregister(0, src, half)

    def flip() -> None:
        while not stop.is_set():
            move("local", "remote")
            time.sleep(0)  # let a reader in between changes, too
            move("remote", "local")
            time.sleep(0)

    t = threading.Thread(target=flip)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns mid-change, as processes would
    t.start()
    try:
        seen = 0
        for _ in range(2000):
            found = reader.lookup(keys)
            if found[0] is None:
                continue  # collided with the writer every try: the engine would ask the agent
            assert {tuple(h.holder_id for h in hs) for hs in found} in ({("local",)}, {("remote",)})
            seen += 1
        assert seen > 0
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(switch)


def test_a_reader_waits_out_a_change_in_progress(shared, monkeypatch, caplog):
    """A change that outlasts the reader's quick tries (a growing table, a writer descheduled
    mid-change on a busy host): the reader naps and reads once the change ends, for up to
    ``READ_WAIT_NS``; past that it gives up, and the engine asks the agent."""
    _, view, reader = shared
    view.slot(0, LOCAL)
    keys = _keys(8)
    view.register(0, "local", to_blob(fingerprints(keys)))

    def change_for(seconds: float) -> threading.Thread:
        started = threading.Event()

        def hold() -> None:
            with view.change():
                started.set()
                time.sleep(seconds)

        t = threading.Thread(target=hold)
        t.start()
        started.wait()
        return t

    monkeypatch.setattr(shm_view, "_unread", Throttled(logging.getLogger(shm_view.__name__)))  # (said before?)
    t = change_for(0.3)  # far past the default wait: the reader gives up after it
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="raykv.directory.shm_view"):
        assert reader.lookup(keys) == [None] * 8
    assert time.monotonic() - t0 < 0.1
    retries = reader.retries  # the same change again: not waited for twice
    assert reader.get(keys[0]) is None and reader.retries - retries == shm_view.READ_TRIES
    t.join()
    assert reader.gave_up["busy"] == 2  # counted, and said once (at most every 10 s)
    assert [r.getMessage() for r in caplog.records if "could not be read (its agent was mid-change" in r.getMessage()]
    assert reader.get(keys[0]) == [LOCAL]  # the change over: read at once

    monkeypatch.setattr(shm_view, "READ_WAIT_NS", 5_000_000_000)  # longer than this test's change
    retries = reader.retries
    t = change_for(0.05)
    t0, cpu0 = time.monotonic(), time.thread_time()
    assert reader.lookup(keys) == [[LOCAL]] * 8  # read after the change, not given up
    waited, cpu = time.monotonic() - t0, time.thread_time() - cpu0
    assert waited >= 0.02 and reader.retries > retries + shm_view.READ_TRIES
    # It napped, leaving its core to the writer it waited for (a yielding reader keeps it: CPU = wall).
    assert cpu < 0.5 * waited, (cpu, waited)
    t.join()


def test_a_silent_writer_is_not_trusted(shared, monkeypatch):
    _, view, reader = shared
    view.slot(0, LOCAL)
    keys = _keys(3)
    view.register(0, "local", to_blob(fingerprints(keys)))
    assert reader.get(keys[0]) == [LOCAL]
    monkeypatch.setattr(shm_view, "STALE_NS", -1)  # as if its last heartbeat were long ago
    stale = reader.gave_up["stale"]
    assert reader.get(keys[0]) is None and reader.lookup(keys) == [None] * 3
    assert reader.gave_up["stale"] == stale + 2
    # A writer that died mid-change: not waited for (a change in progress is, for a while).
    monkeypatch.setattr(shm_view, "READ_WAIT_NS", 5_000_000_000)
    with view.change():
        t0 = time.monotonic()
        assert reader.get(keys[0]) is None and reader.lookup(keys) == [None] * 3
        assert time.monotonic() - t0 < 1.0


def test_a_fresh_view_is_read_before_its_first_change(tmp_path):
    """An agent that has changed nothing yet (no engine stored or asked anything): its view
    is read, and answers like an empty one; no read is given up. Before the first decode
    table was published with the view, every read was given up ("decode")."""
    writer = ViewWriter(view_path("ns", "node-a", str(tmp_path)))
    view = NodeView(
        "node-a", allocate=writer.allocate, changing=writer.changing, all_keys=True, on_complete=writer.set_complete
    )
    writer.publish_from(lambda: view.version, view.decode_table)
    reader = ViewReader(writer.path)
    try:
        assert reader.lookup(_keys(3)) == [None] * 3 and reader.reads == 1
        view.complete = True  # every holder read (none): absent is an answer
        assert reader.lookup(_keys(3)) == [[]] * 3
        assert reader.gave_up == {} and reader.retries == 0
    finally:
        writer.close()


def test_a_holder_table_torn_by_changes_is_read_again(shared, monkeypatch):
    """A decode table read while changes went on (a busy writer, a big table) fails to
    unpickle: the reader reads again, as it does for any read a change tore, rather than
    giving up after its quick tries as if the table were unreadable."""
    _, view, reader = shared
    view.slot(0, LOCAL)
    keys = _keys(4)
    view.register(0, "local", to_blob(fingerprints(keys)))
    view.slot(0, REMOTE)  # a new holder: a new decode table, not yet read by this reader
    view.register(0, "remote", to_blob(fingerprints(keys[:1])))
    loads, tears = shm_view.pickle.loads, []

    def loads_torn_by_changes(data: bytes) -> object:
        if len(tears) < 2 * shm_view.READ_TRIES:  # a change came and went during each of these reads
            tears.append(data)
            with view.change():
                pass
            raise EOFError("torn")
        return loads(data)

    monkeypatch.setattr(shm_view.pickle, "loads", loads_torn_by_changes)
    # the tears, not the clock, are what this test is about: on a loaded host the eight
    # torn reads (each a change) can take longer than the 5 ms a reader waits for a change
    monkeypatch.setattr(shm_view, "READ_WAIT_NS", 5_000_000_000)
    found = reader.lookup(keys)
    assert found[0] is not None and sorted(h.holder_id for h in found[0]) == ["local", "remote"]
    assert found[1:] == [[LOCAL]] * 3
    assert reader.gave_up == {} and reader.retries == 2 * shm_view.READ_TRIES


def test_no_view_means_ask(tmp_path):
    reader = ViewReader(view_path("ns", "nowhere", str(tmp_path)))
    assert reader.lookup(_keys(3)) == [None] * 3 and reader.get(b"x" * 40) is None


def test_a_view_with_no_table_shown_yet_means_ask_without_a_warning(tmp_path, caplog):
    """An agent between creating its view and showing its first table (its header says
    generation 0): readers ask the agent at once, as with no view, and warn of nothing.
    Before, each read tried ``READ_TRIES`` times and was given up with a warning."""
    writer = ViewWriter(view_path("ns", "node-a", str(tmp_path)))
    reader = ViewReader(writer.path)
    try:
        with caplog.at_level(logging.WARNING, logger=shm_view.__name__):
            assert reader.lookup(_keys(3)) == [None] * 3 and reader.get(b"x" * 40) is None
        assert reader.gave_up == {"no view": 2} and reader.unread == "no view" and reader.retries == 0
        assert not [r for r in caplog.records if "could not be read" in r.getMessage()], caplog.text
    finally:
        writer.close()


def test_view_keeps_local_keys_when_full(tmp_path):
    view = NodeView("node-a", max_keys=2000)
    view.slot(0, LOCAL)
    shard = DirectoryShardImpl(0, 1)
    shard.add_holder(REMOTE)
    local = fingerprints(_keys(1000))
    view.register(0, "local", to_blob(local))
    for _ in range(3):  # remote answers, 3x what still fits
        fps = fingerprints(_keys(800))
        shard.register("remote", to_blob(fps))
        view.learn(0, fps, shard.lookup(to_blob(fps)))
    assert view.resets >= 1 and view.live_keys() <= 2000
    assert view.table.capacity <= 8192  # sized for what it keeps, not grown by each drop
    known, ids = view.lookup(local)
    assert known.all() and np.all(ids != 0)  # the node's own keys stayed
    view.reset()
    assert view.known_keys() == 0 and view.table.capacity == 1024  # the smallest table again


def test_a_complete_view_answers_nobody_for_what_it_does_not_list(tmp_path):
    writer = ViewWriter(view_path("ns", "node-a", str(tmp_path)))
    view = NodeView(
        "node-a",
        max_keys=3000,
        allocate=writer.allocate,
        changing=writer.changing,
        all_keys=True,
        on_complete=writer.set_complete,
    )
    writer.publish_from(lambda: view.version, view.decode_table)
    reader = ViewReader(writer.path)
    try:
        view.slot(0, REMOTE)
        held, other = _keys(10), _keys(5)
        view.register(0, "remote", to_blob(fingerprints(held)))  # another node's keys: taken, unasked
        assert reader.lookup(held) == [[REMOTE]] * 10
        assert reader.lookup(other) == [None] * 5  # not complete yet: unknown, ask
        view.complete = True  # the agent read every holder of every shard
        assert reader.lookup(other) == [[]] * 5 and reader.get(other[0]) == []  # nobody: no call needed
        view.reset()  # a shard's feed had a gap
        assert reader.lookup(held + other) == [None] * 15
        view.complete = True
        view.register(0, "remote", to_blob(fingerprints(_keys(4000))))  # the directory outgrew the view
        assert not view.all_keys and not view.complete
        assert reader.lookup(other) == [None] * 5
    finally:
        writer.close()


@pytest.fixture
def small_tmpfs(tmp_path, request):
    """A tmpfs of ``request.param`` bytes (a container's small ``/dev/shm``)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _published(folder) -> NodeView:
    writer = ViewWriter(view_path("ns", "node-a", str(folder)))
    view = NodeView("node-a", allocate=writer.allocate, changing=writer.changing)
    writer.publish_from(lambda: view.version, view.decode_table)
    view.writer = writer  # (for the test)
    return view


@pytest.mark.parametrize("small_tmpfs", [4 << 20], indirect=True)
def test_a_view_with_no_room_in_shm_stays_in_the_agent(small_tmpfs, caplog):
    """/dev/shm smaller than the view's header (Docker's default is 64 MiB, and a node's
    CPU primaries may take most of it): the agent keeps its view in its own memory and
    says so once; engines find no view and ask the agent. Nothing is left in the folder."""
    with caplog.at_level(logging.WARNING, logger=shm_view.__name__):
        view = _published(small_tmpfs)
    assert view.writer.published is False
    [warning] = [r.getMessage() for r in caplog.records if "not in shared memory" in r.getMessage()]
    assert "No space left on device" in warning and "MiB free of 4 MiB" in warning, warning
    assert os.listdir(small_tmpfs) == []
    view.slot(0, LOCAL)
    keys = _keys(50)
    fps = fingerprints(keys)
    view.register(0, "local", to_blob(fps))
    ids, _ = view.lookup(fps)
    assert (ids > 0).all()  # the agent answers from its own copy
    reader = ViewReader(view.writer.path)
    assert reader.lookup(keys) == [None] * 50 and reader.gave_up["no view"] == 1  # engines: ask the agent


@pytest.mark.parametrize("small_tmpfs", [(8 << 20) + (1 << 20)], indirect=True)
def test_a_view_that_outgrows_shm_stops_being_published_without_sigbus(small_tmpfs, caplog):
    """The view fits at first and its table then grows past the room left: the writer
    stops publishing (readers see the view stale and ask the agent) instead of dying of
    SIGBUS at its first write to a page tmpfs has no room for (pages are allocated when
    a file is made: ``posix_fallocate``)."""
    view = _published(small_tmpfs)
    assert view.writer.published
    view.slot(0, LOCAL)
    reader = ViewReader(view.writer.path)
    first = _keys(100)
    view.register(0, "local", to_blob(fingerprints(first)))
    assert reader.lookup(first) == [[LOCAL]] * 100
    more = _keys(200_000, salt=1)  # 12-24 bytes a key: over the 1 MiB left
    with caplog.at_level(logging.WARNING, logger=shm_view.__name__):
        view.register(0, "local", to_blob(fingerprints(more)))
    assert view.writer.published is False
    assert [r for r in caplog.records if "not in shared memory" in r.getMessage()]
    assert os.listdir(small_tmpfs) == []
    ids, _ = view.lookup(fingerprints(first + more))
    assert (ids > 0).all()  # every key still in the agent's copy
    assert reader.lookup(first) == [None] * 100 and reader.gave_up["stale"] == 1  # not trusted: ask the agent
    view.writer.beat()  # no beat revives an unpublished view
    assert reader.get(first[0]) is None


def test_an_agents_next_life_replaces_its_view_and_readers_follow(tmp_path):
    """An agent restarted after a crash makes a new file (renamed over the old one:
    a reader's map of the old one is never truncated under it) and marks the old one
    stale: readers read the new life's view within ``ATTACH_EVERY_S``, not the 5 s
    after which a silent view is dropped."""
    first = _published(tmp_path)
    first.slot(0, LOCAL)
    old, new = _keys(3), _keys(3, salt=1)
    first.register(0, "local", to_blob(fingerprints(old)))
    reader = ViewReader(first.writer.path)
    assert reader.lookup(old) == [[LOCAL]] * 3
    second = _published(tmp_path)  # the crashed life's files are left as they were
    second.slot(0, LOCAL)
    second.register(0, "local", to_blob(fingerprints(new)))
    assert reader.lookup(new) == [None] * 3  # the old life's view: stale now, not read
    t0 = time.monotonic()
    while reader.lookup(new) != [[LOCAL]] * 3:
        assert time.monotonic() - t0 < 2.0, reader.gave_up
        time.sleep(0.01)
    assert reader.lookup(old) == [None] * 3
    second.writer.close()

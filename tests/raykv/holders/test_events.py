"""The holdings log behind KV events: exact for a reader, empty without one."""

from __future__ import annotations

from raykv.holders.events import HoldingsLog

TAG = b"T" * 8


def _key(i: int) -> bytes:
    return TAG + i.to_bytes(4, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_reader_sees_every_batch_after_its_snapshot() -> None:
    clock = Clock()
    log = HoldingsLog(reader_idle_s=60, clock=clock)
    held = [_key(0)]
    first = log.read(None, TAG, lambda: held)
    assert first.snapshot == [_key(0)] and first.events == []
    log.append(False, [_key(1), b"other-id" + b"\0" * 4])
    log.append(True, [_key(0)])
    out = log.read(first.next, TAG, lambda: held)
    assert out.snapshot is None
    assert out.events == [(False, [_key(1)]), (True, [_key(0)])]


def test_no_reader_no_history() -> None:
    clock = Clock()
    log = HoldingsLog(reader_idle_s=60, clock=clock)
    for i in range(1000):
        log.append(False, [_key(i)])
    assert log.num_keys == 0  # never read: nothing kept
    seq = log.read(None, TAG, lambda: []).next
    log.append(False, [_key(1)])
    assert log.num_keys == 1  # a reader now: kept
    clock.now += 61  # the reader went quiet
    log.append(False, [_key(2)])
    assert log.num_keys == 0
    # it comes back from where it was: the ring no longer holds that, so a snapshot
    back = log.read(seq, TAG, lambda: [_key(1), _key(2)])
    assert back.snapshot == [_key(1), _key(2)]
    log.append(True, [_key(1)])
    assert log.read(back.next, TAG, lambda: [_key(2)]).events == [(True, [_key(1)])]


def test_the_ring_stays_bounded_for_a_reader() -> None:
    clock = Clock()
    log = HoldingsLog(max_keys=100, clock=clock)
    log.read(None, TAG, lambda: [])
    for i in range(500):
        log.append(False, [_key(i)])
    assert log.num_keys <= 100

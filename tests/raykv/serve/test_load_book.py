"""The router's bookkeeping of what it sent where (``raykv.serve.load_book``), without Ray."""

from __future__ import annotations

from raykv.serve.load_book import EXPECTED_S, ExpectedRoutes, InflightRequests, PredictedWork, RecentPrefixes


def test_requests_count_while_in_flight_on_the_replica_they_were_routed_to() -> None:
    book: InflightRequests[str] = InflightRequests()
    book.routed("r1", "a")
    book.routed("r2", "a")
    book.routed("r3", "b")
    assert (book.count("a"), book.count("b")) == (2, 1)
    book.completed("r1", "a")
    book.completed("r3", "b")
    assert (book.count("a"), book.count("b")) == (1, 0)
    book.completed("r3", "b")  # twice: counts nothing more
    assert book.count("b") == 0


def test_a_completion_heard_first_makes_the_late_routing_count_nothing() -> None:
    book: InflightRequests[str] = InflightRequests(remember_early=3)
    book.completed("early", "a")
    book.routed("early", "a")
    assert book.count("a") == 0
    # rejected by a (ended without routing), then accepted by b: counted on b
    book.completed("retried", "a")
    book.routed("retried", "b")
    assert (book.count("a"), book.count("b")) == (0, 1)
    for i in range(10):
        book.completed(f"rejected-{i}", "a")
    assert book.remembered_early == 3


def test_the_routed_replica_is_charged_its_predicted_blocks() -> None:
    work: PredictedWork[str] = PredictedWork(max_pending=2)
    work.predict(1, {"a": 4, "b": 0})
    work.predict(2, {"a": 3, "b": 3})
    work.routed(1, "a")
    work.routed(2, "b")
    work.routed(2, "a")  # a request is charged once
    assert (work.sent("a"), work.sent("b")) == (4.0, 3.0)
    for i in range(3, 6):
        work.predict(i, {"a": 1})
    work.routed(3, "a")  # forgotten: only the newest max_pending predictions are kept
    assert work.sent("a") == 4.0
    work.routed(5, "a")
    assert work.sent("a") == 5.0


def test_blocks_sent_to_a_replica_count_as_held_there_for_a_while() -> None:
    recent: RecentPrefixes[str] = RecentPrefixes(ttl_s=10.0)
    keys = [bytes([i]) * 8 for i in range(6)]
    recent.predict(1, keys[:4])
    assert recent.leading(keys, now=0.0) == {}  # not routed yet
    recent.routed(1, "ra", now=0.0)
    assert recent.leading(keys, now=5.0) == {"ra": 4}
    assert recent.leading(keys[1:], now=5.0) == {"ra": 3}
    recent.predict(2, keys[2:])  # a later request computes the rest elsewhere
    recent.routed(2, "rb", now=6.0)
    assert recent.leading(keys, now=7.0) == {"ra": 2}
    assert recent.leading(keys, now=11.0) == {}  # past its time: the directory knows by now
    recent.routed(3, "rc", now=0.0)  # a request never predicted: nothing recorded
    assert recent.leading(keys[2:], now=12.0) == {"rb": 4}


def test_a_decided_request_counts_where_it_ranked_first_until_settled_or_expired() -> None:
    expected: ExpectedRoutes[str] = ExpectedRoutes(ttl_s=2.0)
    expected.expect(1, "a", now=0.0)
    expected.expect(2, "a", now=0.5)
    expected.expect(3, "b", now=1.0)
    assert expected.counts(1.0) == {"a": 2, "b": 1}
    expected.expect(2, "b", now=1.2)  # decided again: counts once, where it ranks now
    assert expected.counts(1.2) == {"a": 1, "b": 2}
    expected.settled(3)  # Serve reported it routed
    assert expected.counts(1.2) == {"a": 1, "b": 1}
    assert expected.counts(2.1) == {"b": 1}  # request 1's two seconds are over
    assert expected.counts(3.3) == {}


def test_a_decided_prefix_is_held_soon_where_it_ranked_first_unless_already_routed() -> None:
    recent: RecentPrefixes[str] = RecentPrefixes(ttl_s=10.0)
    recent.predict(1, [b"k1", b"k2"])
    recent.routed(1, "a", now=0.0)
    # decided, not routed yet: its new blocks count on "b" for EXPECTED_S; the routed ones stay "a"'s
    recent.predict(2, [b"k1", b"k2", b"k3"], expected="b", now=1.0)
    assert recent.leading([b"k1", b"k2", b"k3"], now=1.0) == {"a": 2}
    assert recent.leading([b"k3"], now=1.0) == {"b": 1}
    assert recent.leading([b"k3"], now=1.0 + EXPECTED_S + 0.1) == {}
    recent.routed(2, "c", now=2.0)  # where it went: held there for the full ttl
    assert recent.leading([b"k3"], now=2.0 + EXPECTED_S + 0.1) == {"c": 1}

"""``PinRenewals``: a request with ``cache_ttl_s`` has its prompt keys touched once,
at the first step's end after the engine listed them; others are never held."""

from __future__ import annotations

from raykv.core.contract import ReqContext
from raykv.core.keys import prefix_keys
from raykv.engine.pin_renewal import MAX_STEPS, PinRenewals


def _req(req_id: str, params: dict | None, listed: list[bytes] | None) -> ReqContext:
    return ReqContext(req_id, params, prefix_keys=(lambda: list(listed)) if listed is not None else None)


def test_a_ttl_request_is_due_once_its_keys_are_listed() -> None:
    renewals = PinRenewals()
    listed: list[bytes] = []
    req = _req("a", {"cache_ttl_s": 600}, listed)
    renewals.add(req)
    assert renewals.due() == [] and len(renewals) == 1  # not listed yet: waits
    keys = prefix_keys(list(range(64)), 16)
    listed += keys
    assert renewals.due() == [(req, keys)]
    assert renewals.due() == [] and len(renewals) == 0  # once


def test_requests_without_a_ttl_or_keys_are_not_held() -> None:
    renewals = PinRenewals()
    renewals.add(_req("none", None, []))
    renewals.add(_req("bad", {"cache_ttl_s": "ten"}, []))  # malformed: ignored, like the tier does
    renewals.add(_req("unlisted", {"cache_ttl_s": 60}, None))  # vLLM 0.29 lists no keys
    assert len(renewals) == 0


def test_a_request_never_listed_is_dropped() -> None:
    renewals = PinRenewals()
    renewals.add(_req("a", {"cache_ttl_s": 60}, []))
    for _ in range(MAX_STEPS):
        assert renewals.due() == []
    assert len(renewals) == 0

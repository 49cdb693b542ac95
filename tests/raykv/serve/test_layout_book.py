"""The router's engine layouts: read once and waited for, then refreshed without making a decision wait."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from raykv.core.errors import RaykvError
from raykv.core.identity import KVIdentity
from raykv.serve import layout_book
from raykv.serve.layout_book import LayoutBook


class SlowIdentities:
    """The control actor's ``identities`` call, answering after ``delay_s``."""

    def __init__(self, identities: dict[str, KVIdentity], delay_s: float) -> None:
        self.identities, self.delay_s, self.calls = identities, delay_s, 0

    async def remote(self) -> dict[str, KVIdentity]:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return dict(self.identities)


def test_a_refresh_never_holds_a_decision_back(monkeypatch) -> None:
    tiny = KVIdentity(model="tiny", layout={"tokens_per_hash": 16, "rank": 0})
    other = KVIdentity(model="other", layout={"tokens_per_hash": 16, "rank": 0})
    second_rank = KVIdentity(model="tiny", layout={"tokens_per_hash": 16, "rank": 1})
    call = SlowIdentities({"00" * 8: tiny, "11" * 8: other, "22" * 8: second_rank}, delay_s=0.3)
    book = LayoutBook("tiny", "ns")
    book.services = types.SimpleNamespace(control=types.SimpleNamespace(identities=call))  # type: ignore[assignment]

    async def main() -> None:
        t0 = time.monotonic()
        first = await book.layouts()  # nothing known yet: read and waited for
        assert time.monotonic() - t0 >= 0.3 and [x.tag.hex() for x in first] == ["00" * 8]
        monkeypatch.setattr(layout_book, "IDENTITY_REFRESH_S", 0.0)
        call.identities["33" * 8] = KVIdentity(model="tiny", layout={"tokens_per_hash": 32, "rank": 0})
        t0 = time.monotonic()
        again = await book.layouts()  # stale: the refresh starts, the decision goes on with what is known
        assert time.monotonic() - t0 < 0.1 and again == first
        await asyncio.sleep(0.5)
        assert call.calls == 2
        assert [x.tag.hex() for x in await book.layouts()] == ["00" * 8, "33" * 8]

    asyncio.run(main())


def test_the_router_attaches_again_after_raykv_is_stopped_and_started(ray_local, monkeypatch) -> None:
    """Real local Ray; `raykv stop` and `raykv start` run by the CLI in another process, as an operator would."""
    import ray

    import raykv
    from tests.cli_run import run_raykv
    from tests.waiting import wait_until

    namespace = "raykv-layout-book-restart"
    tiny = KVIdentity(model="tiny", layout={"tokens_per_hash": 16, "rank": 0})
    raykv.start({"namespace": namespace}).register_identity(tiny)
    address = ray.get_runtime_context().gcs_address
    book = LayoutBook("tiny", namespace)
    monkeypatch.setattr(layout_book, "IDENTITY_REFRESH_S", 0.0)
    monkeypatch.setattr(layout_book, "FIRST_READ_EVERY_S", 0.0)

    async def read() -> list[str]:
        layouts = await book.layouts()
        if book._refresh is not None:
            await book._refresh  # the background refresh a decision started
        return [x.tag.hex() for x in layouts]

    # register_identity is fire-and-forget from this driver and the book reads through a
    # handle of its own, so Ray may run the read first: wait for the registration to land.
    wait_until(lambda: asyncio.run(read()) == [tiny.tag_hex], timeout_s=20.0, what="the first layouts read")
    first = book.services
    assert run_raykv("stop", namespace=namespace, address=address).returncode == 0
    asyncio.run(read())  # the refresh finds the control actor dead: services and layouts forgotten
    assert book.services is None
    with pytest.raises(RaykvError, match="raykv is not running"):  # the decision falls back to load alone
        asyncio.run(book.layouts())
    assert run_raykv("start", namespace=namespace, address=address).returncode == 0
    raykv.attach(namespace).register_identity(tiny)  # what a reattached engine does
    wait_until(lambda: asyncio.run(read()) == [tiny.tag_hex], timeout_s=20.0, what="the layouts read anew")
    assert book.services is not None and book.services is not first
    raykv.attach(namespace).shutdown()

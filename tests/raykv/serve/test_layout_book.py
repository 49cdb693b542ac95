"""The router's engine layouts: read once and waited for, then refreshed without making a decision wait."""

from __future__ import annotations

import asyncio
import time
import types

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

"""``LayoutBook``: the KV layouts of one model's engines, as the raykv router needs them.

The router names a prompt's keys per engine layout (identity tag, tokens per
block hash, blocks per chunk: ``EngineLayout``), read from the control
actor's registered identities. Once known they are refreshed in the
background, so a routing decision never waits on that call; only the first
decisions (nothing known yet) do, at most once a second. A refresh that finds
raykv stopped forgets its services and layouts (decisions fall back to load
alone) and attaches again, at most once a second, once raykv is started anew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ray.exceptions import ActorDiedError

from raykv.core.tenants import ISOLATED, TenantSharing
from raykv.serve.routing import EngineLayout

if TYPE_CHECKING:
    from raykv.services.cluster import RaykvServices

logger = logging.getLogger(__name__)

#: How often the layouts are read again (new models, restarted engines).
IDENTITY_REFRESH_S = 10.0
#: While none is known, how often a decision may read them (and wait for it).
FIRST_READ_EVERY_S = 1.0


class LayoutBook:
    """The rank-0 engine layouts of ``model`` in raykv namespace ``namespace``."""

    def __init__(self, model: str, namespace: str) -> None:
        self.model = model
        self.namespace = namespace
        #: raykv's services, attached at the first read (the router's directory reads use them).
        self.services: RaykvServices | None = None
        #: Which tenants share blocks (the namespace's ``shared_tenants``), read with the services.
        self.sharing: TenantSharing = ISOLATED
        self._layouts: list[EngineLayout] = []
        self._read_at = -1e9
        self._refresh: asyncio.Task[None] | None = None

    async def layouts(self) -> list[EngineLayout]:
        """The layouts known now; read (and waited for) only while none is known."""
        now = time.monotonic()
        if self._layouts:
            if now - self._read_at >= IDENTITY_REFRESH_S and (self._refresh is None or self._refresh.done()):
                self._read_at = now
                self._refresh = asyncio.get_running_loop().create_task(self._read_logged())
            return self._layouts
        if now - self._read_at >= FIRST_READ_EVERY_S:
            self._read_at = now
            await self._read()
        return self._layouts

    async def _read(self) -> None:
        if self.services is None:
            from raykv.services.cluster import attach

            self.services = await asyncio.to_thread(attach, self.namespace)
            self.sharing = TenantSharing(getattr(self.services.config, "shared_tenants", None))
        try:
            identities = await self.services.control.identities.remote()
        except ActorDiedError:
            # raykv was stopped (``raykv stop``; Ray restarts a crashed control actor):
            # forget its services, so a later read attaches to a raykv started anew.
            self.services.retire()
            self.services, self._layouts = None, []
            raise
        self._layouts = [
            EngineLayout.from_identity(tag, ident)
            for tag, ident in sorted(identities.items())
            if ident.model == self.model and ident.layout.get("rank", 0) in (0, "0")
        ]

    async def _read_logged(self) -> None:
        try:
            await self._read()
        except Exception as e:  # noqa: BLE001 - the known layouts serve on; the next refresh tries again
            logger.warning("raykv router: engine identities not refreshed: %r", e)

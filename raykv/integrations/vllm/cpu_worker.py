"""Offloading worker for engines whose KV cache lives in host memory (vLLM CPU).

vLLM's `CPUOffloadingWorker` copies with CUDA streams and DMA descriptors. This
worker does the same page moves synchronously with torch indexing ops, between
the engine's KV tensors and the primary tier's shared mmap region, using the
same chunk / sub-block arithmetic (one offloaded chunk = `blocks_per_chunk`
engine blocks; a group's first chunk may be entered part-way, at
`block_indices[g] % blocks_per_chunk`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from raykv.integrations.vllm import require_vllm

require_vllm()

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import (  # noqa: E402
    SharedOffloadRegion,
)

logger = init_logger(__name__)


@dataclass(frozen=True)
class PageIndex:
    """Where `n` engine blocks of one KV group sit on each side of a transfer."""

    engine_blocks: torch.Tensor  # (n,) int64 engine block ids
    chunks: torch.Tensor  # (n,) int64 primary chunk ids
    sub_blocks: torch.Tensor  # (n,) int64 block slot inside each chunk


def plan_group_pages(
    engine_spec: GPULoadStoreSpec,
    chunk_spec: BlockIDsLoadStoreSpec,
    blocks_per_chunk: int,
) -> list[PageIndex | None]:
    """Per KV group, pair each engine block with its (chunk, sub-block) slot.

    Mirrors `SingleDirectionOffloadingHandler.transfer_async`: groups are laid
    out back to back in both block lists; group g covers engine blocks
    `block_indices[g] ...` of its request, so its first chunk skips
    `block_indices[g] % blocks_per_chunk` slots. Groups with no blocks -> None.
    """
    engine_ids = engine_spec.block_ids
    chunk_ids = chunk_spec.block_ids
    pages: list[PageIndex | None] = []
    e_off = c_off = 0
    for size, first in zip(engine_spec.group_sizes, engine_spec.block_indices):
        if size == 0:
            pages.append(None)
            continue
        skip = first % blocks_per_chunk
        n_chunks = -(-(size + skip) // blocks_per_chunk)
        logical = np.arange(skip, skip + size)
        chunks = chunk_ids[c_off : c_off + n_chunks][logical // blocks_per_chunk]
        pages.append(
            PageIndex(
                engine_blocks=torch.from_numpy(engine_ids[e_off : e_off + size].astype(np.int64)),
                chunks=torch.from_numpy(chunks.astype(np.int64)),
                sub_blocks=torch.from_numpy(logical % blocks_per_chunk),
            )
        )
        e_off += size
        c_off += n_chunks
    if e_off != len(engine_ids) or c_off != len(chunk_ids):
        raise ValueError(
            f"transfer spec mismatch: used {e_off}/{len(engine_ids)} engine blocks and {c_off}/{len(chunk_ids)} chunks"
        )
    return pages


class SyncCopyOffloadingWorker(OffloadingWorker):
    """Copies KV pages synchronously between engine tensors and the primary.

    Only torch indexing ops (`index_select`, `index_put_`, `index_copy_`) touch
    the data, so the code would also run with accelerator-resident KV (with a
    device hop per copy); on CUDA/XPU vLLM's async worker is used instead.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
    ):
        self._region: SharedOffloadRegion | None = region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        # engine side: (num_blocks, page) int8; primary side:
        # (num_chunks, blocks_per_chunk, page) int8 strided view of the mmap.
        self._engine: list[torch.Tensor] = []
        self._primary: list[torch.Tensor] = []
        for kv in kv_caches.tensors:
            page = kv.page_size_bytes
            self._engine.append(kv.tensor.view(torch.int8).view(-1, page))
            view = region.create_next_worker_view(page * blocks_per_chunk)
            self._primary.append(view.unflatten(1, (blocks_per_chunk, page)))
        self._finished: list[TransferResult] = []

    def _transfer(
        self,
        job_id: int,
        engine_spec: GPULoadStoreSpec,
        chunk_spec: LoadStoreSpec,
        store: bool,
    ) -> bool:
        assert isinstance(chunk_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        pages = plan_group_pages(engine_spec, chunk_spec, self._blocks_per_chunk)
        if len(pages) != len(self._refs):
            raise ValueError(f"{len(pages)} KV groups in spec, {len(self._refs)} known")
        num_bytes = 0
        for idx, refs in zip(pages, self._refs):
            if idx is None:
                continue
            for ref in refs:
                # Only the un-padded part of each page holds KV.
                size = ref.page_size_bytes
                engine = self._engine[ref.tensor_idx][:, :size]
                primary = self._primary[ref.tensor_idx][:, :, :size]
                if store:
                    src = engine.index_select(0, idx.engine_blocks.to(engine.device))
                    primary.index_put_((idx.chunks, idx.sub_blocks), src.to(primary.device))
                else:
                    src = primary[idx.chunks, idx.sub_blocks]
                    engine.index_copy_(
                        0,
                        idx.engine_blocks.to(engine.device),
                        src.to(engine.device),
                    )
                num_bytes += len(idx.engine_blocks) * size
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Engine -> primary, done before returning."""
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Primary -> engine, done before returning (so ``expedited``, vLLM 0.33+'s sync loads, changes nothing)."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job completes inside its submit call

    def shutdown(self) -> None:
        self._engine.clear()
        self._primary.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None

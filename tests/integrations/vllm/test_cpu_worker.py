"""SyncCopyOffloadingWorker against vLLM's own spec / region / pointer math."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import (  # noqa: E402
    SharedOffloadRegion,
)

from raykv.integrations.vllm.cpu_worker import (  # noqa: E402
    SyncCopyOffloadingWorker,
    plan_group_pages,
)

NUM_BLOCKS, NUM_CHUNKS, BPC = 12, 8, 2
PAGES = (2048, 4096)  # engine page bytes of tensor 0 / tensor 1
UNPADDED = (2000, 4096)  # tensor 0 has padding that must not be copied
ROW = sum(PAGES) * BPC  # 12 KiB: page aligned


@pytest.fixture
def rig() -> Iterator[tuple[SyncCopyOffloadingWorker, list[torch.Tensor], np.ndarray]]:
    gen = torch.Generator().manual_seed(0)
    engine = [torch.randint(-128, 128, (NUM_BLOCKS, p), dtype=torch.int8, generator=gen) for p in PAGES]
    # Two KV groups (as with hybrid models): group 0 -> tensor 0, group 1 -> tensor 1.
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(engine, PAGES)],
        group_data_refs=[
            [CanonicalKVCacheRef(0, UNPADDED[0])],
            [CanonicalKVCacheRef(1, UNPADDED[1])],
        ],
    )
    engine_id = f"raykv-test-{uuid.uuid4().hex}"
    scheduler = SharedOffloadRegion(engine_id, NUM_CHUNKS, None, ROW, ROW)
    region = SharedOffloadRegion(engine_id, NUM_CHUNKS, 0, ROW, ROW)
    worker = SyncCopyOffloadingWorker(kv, BPC, region)
    # What secondary tiers see: (num_chunks, row bytes) over the same mmap.
    view = np.asarray(scheduler.create_kv_memoryview())
    yield worker, engine, view
    worker.shutdown()
    scheduler.cleanup()


def _specs() -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    # group 0: request blocks 1..3 (starts mid-chunk), group 1: blocks 2..3.
    engine = GPULoadStoreSpec([3, 5, 7, 9, 10], group_sizes=[3, 2], block_indices=[1, 2])
    chunks = CPULoadStoreSpec([4, 6, 1])  # 2 chunks for group 0, 1 for group 1
    return engine, chunks


def test_plan_matches_vllm_pointer_math() -> None:
    engine_spec, chunk_spec = _specs()
    pages = plan_group_pages(engine_spec, chunk_spec, BPC)
    # Tensor 0's region view, shaped like the one vLLM's CUDA worker indexes.
    cpu = torch.zeros(NUM_CHUNKS * ROW, dtype=torch.int8).as_strided((NUM_CHUNKS, PAGES[0] * BPC), (ROW, 1))
    c_off = 0
    for g, (size, first) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices)):
        skip = first % BPC
        n_chunks = -(-(size + skip) // BPC)
        expected = np.empty(size, dtype=np.uint64)
        chunks = chunk_spec.block_ids[c_off : c_off + n_chunks]
        compute_sub_block_ptrs(chunks, BPC, expected, cpu, skip)
        page = pages[g]
        assert page is not None
        ours = cpu.data_ptr() + page.chunks.numpy() * ROW + page.sub_blocks.numpy() * PAGES[0]
        assert ours.tolist() == expected.tolist()
        c_off += n_chunks


def test_store_then_load_round_trip(rig) -> None:
    worker, engine, view = rig
    original = [t.clone() for t in engine]
    engine_spec, chunk_spec = _specs()
    assert worker.submit_store(7, engine_spec, chunk_spec)

    # Row layout: [t0 sub0 | t0 sub1 | t1 sub0 | t1 sub1]; group 0 block 1 of
    # the request (engine block 3) lands in chunk 4, slot 1.
    p0, u0, p1 = PAGES[0], UNPADDED[0], PAGES[1]

    def kv(t: int, block: int, size: int) -> bytes:
        return original[t][block, :size].numpy().tobytes()

    assert view[4, p0 : p0 + u0].tobytes() == kv(0, 3, u0)
    assert view[6, 0:u0].tobytes() == kv(0, 5, u0)
    assert view[6, p0 : p0 + u0].tobytes() == kv(0, 7, u0)
    assert not view[4, :p0].any()  # slot 0 of chunk 4 untouched (skipped)
    t1 = 2 * p0  # tensor 1's area starts after tensor 0's two slots
    assert view[1, t1 : t1 + p1].tobytes() == kv(1, 9, p1)
    assert view[1, t1 + p1 : t1 + 2 * p1].tobytes() == kv(1, 10, p1)

    # Load the same chunks into other engine blocks.
    for t in engine:
        t.zero_()
    load_spec = GPULoadStoreSpec([0, 1, 2, 4, 6], group_sizes=[3, 2], block_indices=[1, 2])
    assert worker.submit_load(8, chunk_spec, load_spec)
    for dst, src in zip([0, 1, 2], [3, 5, 7]):
        assert torch.equal(engine[0][dst, : UNPADDED[0]], original[0][src, : UNPADDED[0]])
        assert not engine[0][dst, UNPADDED[0] :].any()  # padding not copied
    for dst, src in zip([4, 6], [9, 10]):
        assert torch.equal(engine[1][dst], original[1][src])

    results = {r.job_id: r for r in worker.get_finished()}
    assert set(results) == {7, 8} and all(r.success for r in results.values())
    assert results[7].transfer_size == 3 * UNPADDED[0] + 2 * UNPADDED[1]
    assert worker.get_finished() == []
    worker.wait({7, 8})  # nothing pending: returns at once


def test_spec_mismatch_is_an_error(rig) -> None:
    worker, _, _ = rig
    engine_spec = GPULoadStoreSpec([3, 5], group_sizes=[2, 0], block_indices=[0, 0])
    with pytest.raises(ValueError, match="mismatch"):
        worker.submit_store(1, engine_spec, CPULoadStoreSpec([4, 6]))  # needs 1 chunk

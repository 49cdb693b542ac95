"""EngineCacheActor on a real local Ray: an engine's events become directory entries of the
ENGINE medium, in order; invalidation drops them; the actor's death drops them at once."""

from __future__ import annotations

import ray

from raykv.core.placement import ENGINE
from raykv.holders.engine_cache import EngineCacheActor, engine_key, holder_info
from tests.waiting import wait_until

TAG_A, TAG_B = b"A" * 8, b"B" * 8


def _listed(services, keys: list[bytes]) -> list[bool]:
    return [any(h.medium == ENGINE for h in hs) for hs in services.directory.lookup(keys)]


def test_events_register_in_order_and_invalidation_drops_them(raykv_services) -> None:
    ns = raykv_services.namespace
    info = holder_info(ns, ray.get_runtime_context().get_node_id(), owner="replica-1", pid=4242)
    actor = EngineCacheActor.options(name=info.actor_name, namespace=ns).remote(info, ns)
    a = [engine_key(TAG_A, i) for i in range(4)]
    b = [engine_key(TAG_B, i) for i in range(2)]
    assert ray.get(actor.apply.remote(a + b, [])) == 6
    assert _listed(raykv_services, a + b) == [True] * 6
    # removed before stored within one batch: a[0] is re-stored, a[1] goes
    assert ray.get(actor.apply.remote([a[0]], [a[0], a[1]])) == 5
    assert _listed(raykv_services, a[:2]) == [True, False]
    # everything cleared, then one block stored again
    assert ray.get(actor.apply.remote([a[3]], [], True, {"object_store": 7})) == 1
    assert _listed(raykv_services, a + b) == [False, False, False, True, False, False]
    stats = ray.get(actor.stats.remote()).figures
    assert stats["blocks"] == 1 and stats["loaded_by_tier"] == {"object_store": 7}
    (holder,) = [h for h in raykv_services.holders() if h.holder_id == info.holder_id]
    assert holder == info and holder.medium == ENGINE and holder.owner == "replica-1"
    assert ray.get(actor.drop_identities.remote([TAG_A])) == 1
    assert _listed(raykv_services, [a[3]]) == [False]
    ray.kill(actor)


def test_a_dead_engine_holder_leaves_the_directory_at_once(raykv_services) -> None:
    ns = raykv_services.namespace
    info = holder_info(ns, ray.get_runtime_context().get_node_id(), owner=None, pid=4343)
    actor = EngineCacheActor.options(name=info.actor_name, namespace=ns).remote(info, ns)
    keys = [engine_key(TAG_A, 100 + i) for i in range(3)]
    ray.get(actor.apply.remote(keys, []))
    assert all(_listed(raykv_services, keys))
    ray.kill(actor)
    wait_until(
        lambda: not any(_listed(raykv_services, keys)),
        timeout_s=10.0,
        interval_s=0.05,
        what="the dead holder's keys to leave",
    )
    wait_until(
        lambda: info.holder_id not in {h.holder_id for h in raykv_services.holders()},
        timeout_s=10.0,
        interval_s=0.05,
        what="membership to drop it",
    )

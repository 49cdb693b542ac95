"""Ray object store (plasma) tier: one ``ObjectStoreActor`` per node owns packed
plasma objects of KV blocks, with a byte capacity and LRU eviction;
``ObjectStoreTier`` is the engine-side client that drives it without blocking."""

from tiers.object_store.actor import ObjectStoreActor
from tiers.object_store.tier import ObjectStoreOptions, ObjectStoreTier

__all__ = ["ObjectStoreActor", "ObjectStoreOptions", "ObjectStoreTier"]

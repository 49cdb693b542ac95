"""Reference tiers: ``ExampleTier`` (process-local, the whole contract in one
file) and ``ExampleNodeTier`` (``node``: cluster-wide on raykv's bases, the
storage and nothing else). ``node`` imports Ray: load it by module."""

from tiers.example.tier import ExampleTier

__all__ = ["ExampleTier"]

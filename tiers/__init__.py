"""raykv's secondary tiers, one subpackage each (imported lazily by the factory)."""

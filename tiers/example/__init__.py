"""In-memory reference tier: the contract's executable documentation."""

from tiers.example.tier import ExampleTier

__all__ = ["ExampleTier"]

"""Offload policy: which requests a tier wants at REQUEST_LEVEL.

- ``rules``: ``PolicyRule`` (validated from config or ``raykv rules add``),
  matching a request, and ``decide``.
- ``cache``: ``PolicyCache``, an engine's versioned copy of the rules the
  control actor keeps (``raykv.services.control``), refreshed by a long poll.
"""

from raykv.policy.cache import PolicyCache
from raykv.policy.rules import PolicyRule, check_rule_tier, decide, request_tenant

__all__ = ["PolicyCache", "PolicyRule", "check_rule_tier", "decide", "request_tenant"]

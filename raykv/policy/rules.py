"""Offload-policy rules: which requests a tier wants at REQUEST_LEVEL.

Rules live at the control actor (``raykv.services.control``); engines keep a versioned copy
(``raykv.policy.cache.PolicyCache``) so ``on_new_request`` never waits on
the network.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from raykv.core.contract import OffloadPolicy, ReqContext, RequestOffloadingContext
from raykv.core.factory import TierFactory
from raykv.core.fields import opt, parse_options
from raykv.core.validate import ConfigError, as_mapping, json_value, request_params, request_tenant_value


def _tier_problem(value: str) -> str | None:
    return None if value.strip() else "must name a tier type ('fs', 'object_store', ...) or '*'"


@dataclass
class _RuleSchema:
    tier: str = opt(kind=str, check=_tier_problem, doc="tier type the rule is for ('fs', 'object_store', '*')")
    policy: str = opt("request_level", kind=str, check=lambda v: _policy_problem(v))
    match: dict = opt({}, kind=dict, doc="{'tenant': ...} and/or {'kv_transfer_params': {...}}")
    name: str = opt("", kind=str)


_MATCH_KEYS = ("tenant", "kv_transfer_params")


def _policy_problem(value: str) -> str | None:
    try:
        OffloadPolicy.parse(value)
    except ValueError:
        return f"must be one of request_level, chunk_level, block_level (any case); got {value!r}"
    return None


@dataclass(frozen=True)
class PolicyRule:
    """``tier`` wants ``policy`` for requests that ``match``.

    ``match`` may name ``tenant`` (equal to the request's tenant) and
    ``kv_transfer_params`` (every given item equal in the request's params).
    An empty match matches every request.
    """

    tier: str
    policy: OffloadPolicy = OffloadPolicy.REQUEST_LEVEL
    tenant: str | None = None
    #: ``kv_transfer_params`` items to match (JSON values, validated).
    params: tuple[tuple[str, object], ...] = field(default=())
    name: str = ""

    @classmethod
    def from_dict(cls, raw: Mapping[str, object], where: str = "rule") -> "PolicyRule":
        s = parse_options(_RuleSchema, raw, where)
        match = as_mapping(s.match, f"{where}.match")
        unknown = sorted(set(match) - set(_MATCH_KEYS))
        if unknown:
            raise ConfigError(f"{where}.match.{unknown[0]}", f"unknown key; allowed keys: {', '.join(_MATCH_KEYS)}")
        tenant = match.get("tenant")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigError(f"{where}.match.tenant", f"must be a non-empty str, got {tenant!r}")
        params = as_mapping(match.get("kv_transfer_params"), f"{where}.match.kv_transfer_params")
        json_value(f"{where}.match.kv_transfer_params", params)
        return cls(
            tier=s.tier,
            policy=OffloadPolicy.parse(s.policy),
            tenant=tenant,
            params=tuple(sorted(params.items())),
            name=s.name,
        )

    def to_dict(self) -> dict[str, object]:
        """The rule as config writes it (``from_dict`` reads it back)."""
        match: dict[str, object] = {}
        if self.tenant is not None:
            match["tenant"] = self.tenant
        if self.params:
            match["kv_transfer_params"] = dict(self.params)
        return {"tier": self.tier, "policy": self.policy.value, "match": match, "name": self.name}

    def matches(self, tier_type: str, req: ReqContext) -> bool:
        if self.tier not in ("*", tier_type):
            return False
        if self.tenant is not None and request_tenant(req) != self.tenant:
            return False
        params = request_params(req.kv_transfer_params) or {}
        return all(k in params and _equal(params[k], v) for k, v in self.params)


def _equal(a: object, b: object) -> bool:
    """``a == b`` for request values, which may be of any type (False when comparing raises)."""
    try:
        return bool(a == b)
    except Exception:
        return False


def request_tenant(req: ReqContext) -> str | None:
    """The tenant of a request: its own field, else ``kv_transfer_params['tenant']``."""
    if req.tenant is not None:
        return req.tenant
    params = request_params(req.kv_transfer_params) or {}
    return request_tenant_value(params.get("tenant"))


def check_rule_tier(tier: str, where: str, configured: Sequence[str] | None = None, also: Iterable[str] = ()) -> None:
    """A rule's ``tier`` must be ``'*'`` or a tier that exists: one of
    ``configured`` when a config lists its tiers, else a known tier type (or
    one of ``also``)."""
    if tier == "*":
        return
    if configured is not None:
        if tier not in configured:
            raise ConfigError(
                where,
                f"no tier of type {tier!r} is configured; configured: {', '.join(sorted(set(configured)))} "
                "(or '*' for every tier)",
            )
        return
    known = sorted({*TierFactory.known_types(), *also})
    if tier not in known:
        raise ConfigError(where, f"unknown tier type {tier!r}; known types: {', '.join(known)} (or '*' for every tier)")


def decide(rules: Iterable[PolicyRule], tier_type: str, req: ReqContext) -> RequestOffloadingContext:
    """The policy ``tier_type`` wants for ``req``: REQUEST_LEVEL if any rule says so."""
    for rule in rules:
        if rule.policy is OffloadPolicy.REQUEST_LEVEL and rule.matches(tier_type, req):
            return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL, frozenset({tier_type}))
    return RequestOffloadingContext()

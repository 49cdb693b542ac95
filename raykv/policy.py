"""Offload-policy rules: which requests a tier wants at REQUEST_LEVEL.

Rules live at the directory's policy registry; engines keep a versioned copy
(``raykv.directory.client.PolicyCache``) so ``on_new_request`` never waits on
the network.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raykv.config import ConfigError, opt, parse_options
from raykv.contract import OffloadPolicy, ReqContext, RequestOffloadingContext


@dataclass
class _RuleSchema:
    tier: str = opt(kind=str, doc="tier type the rule is for ('fs', 'object_store', '*')")
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
    params: tuple[tuple[str, Any], ...] = field(default=())
    name: str = ""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "rule") -> "PolicyRule":
        s = parse_options(_RuleSchema, raw, where)
        unknown = sorted(set(s.match) - set(_MATCH_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}.match.{unknown[0]}", f"unknown key; allowed keys: {', '.join(_MATCH_KEYS)}"
            )
        tenant = s.match.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise ConfigError(f"{where}.match.tenant", "must be str")
        params = s.match.get("kv_transfer_params", {})
        if not isinstance(params, Mapping):
            raise ConfigError(f"{where}.match.kv_transfer_params", "must be a mapping")
        return cls(
            tier=s.tier,
            policy=OffloadPolicy.parse(s.policy),
            tenant=tenant,
            params=tuple(sorted(params.items())),
            name=s.name,
        )

    def to_dict(self) -> dict[str, Any]:
        match: dict[str, Any] = {}
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
        params = req.kv_transfer_params or {}
        return all(k in params and params[k] == v for k, v in self.params)


def request_tenant(req: ReqContext) -> str | None:
    """The tenant of a request: its own field, else ``kv_transfer_params['tenant']``."""
    if req.tenant is not None:
        return req.tenant
    params = req.kv_transfer_params or {}
    tenant = params.get("tenant")
    return str(tenant) if tenant is not None else None


def decide(rules: Iterable[PolicyRule], tier_type: str, req: ReqContext) -> RequestOffloadingContext:
    """The policy ``tier_type`` wants for ``req``: REQUEST_LEVEL if any rule says so."""
    for rule in rules:
        if rule.policy is OffloadPolicy.REQUEST_LEVEL and rule.matches(tier_type, req):
            return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL, frozenset({tier_type}))
    return RequestOffloadingContext()

"""The validation layer (raykv/core/validate.py): a property-based test over generated
config trees, and odd per-request ``kv_transfer_params`` in the policy code."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raykv.config.options import RaykvConfig
from raykv.core.contract import OffloadPolicy, ReqContext
from raykv.core.factory import TierFactory
from raykv.core.validate import TOP, ConfigError, key_name, request_params
from raykv.integrations.vllm import raykv_kv_transfer_config
from raykv.policy import PolicyRule, decide, request_tenant


def _option_names() -> list[str]:
    names = {f.name for f in dataclasses.fields(RaykvConfig)}
    for t in TierFactory.known_types():
        names |= {f.name for f in dataclasses.fields(TierFactory.get_tier_class({"type": t}).Options)}
    return sorted(names | {"type", "module_path", "tier", "policy", "match", "name", "tenant", "kv_transfer_params"})


NAMES = _option_names()
WORDS = [
    "fs",
    "object_store",
    "example",
    "*",
    "",
    "raykv",
    "other-ns",
    "/tmp/raykv-prop",
    "/tmp//raykv-prop/",
    "relative/root",
    "s3://bucket/kv",
    "request_level",
    "chunk_level",
    "persist",
    "tiers.example",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 4, 64, 4096, 1 << 30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS),
    st.text(max_size=6),
)
keys = st.one_of(st.sampled_from(NAMES), st.text(max_size=5), st.integers(0, 3))
trees = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=5)),
    max_leaves=25,
)


def _tier() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"type": st.sampled_from(["fs", "object_store", "example", "redis", ""])},
        optional={name: st.one_of(scalars, trees) for name in NAMES if name != "type"},
    )


def _rule() -> st.SearchStrategy:
    match = st.fixed_dictionaries(
        {},
        optional={"tenant": scalars, "kv_transfer_params": st.one_of(trees, st.dictionaries(keys, trees, max_size=3))},
    )
    return st.fixed_dictionaries(
        {"tier": st.one_of(st.sampled_from(WORDS), scalars)},
        optional={
            "policy": st.one_of(st.sampled_from(["request_level", "CHUNK_LEVEL", "block_level", "x"]), scalars),
            "match": st.one_of(match, trees),
            "name": st.one_of(st.sampled_from(["a", "b"]), scalars),
        },
    )


# Configs shaped like real ones (so many validate), and arbitrary trees (so every shape is tried).
configs = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "namespace": st.one_of(st.sampled_from(["raykv", "other-ns", "bad ns", ""]), scalars),
            "directory_shards": scalars,
            "policy_refresh_s": scalars,
            "lookup_ttl_s": scalars,
            "tiers": st.one_of(st.lists(_tier(), max_size=3), trees),
            "rules": st.one_of(st.lists(_rule(), max_size=3), trees),
        },
    ),
    trees,
)

_outcomes = {"valid": 0, "rejected": 0}


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_every_config_tree_validates_or_names_a_field(tree) -> None:
    try:
        cfg = RaykvConfig.from_dict(tree)
    except ConfigError as e:
        _outcomes["rejected"] += 1
        assert isinstance(e.field, str) and e.field, repr(e)
        assert str(e).startswith(f"{e.field}: ") and len(str(e)) > len(e.field) + 2, str(e)
        named = {TOP, *(map(key_name, tree) if isinstance(tree, dict) else ())}
        assert any(e.field == n or e.field.startswith((f"{n}.", f"{n}[")) for n in named), (e.field, tree)
        # the same tree through the vLLM entry point: the same field
        with pytest.raises(ConfigError) as again:
            raykv_kv_transfer_config(tree)
        assert again.value.field == e.field
        return
    _outcomes["valid"] += 1
    for value in (cfg.directory_shards, cfg.policy_refresh_s, cfg.lookup_ttl_s):
        assert math.isfinite(value) and value >= 0
    kv = raykv_kv_transfer_config(tree)
    assert len(kv["kv_connector_extra_config"]["secondary_tiers"]) == len(cfg.tiers)


def test_the_property_test_reached_both_outcomes() -> None:
    """Guards the generator: it must produce valid configs, not only rejections."""
    if not _outcomes["valid"] + _outcomes["rejected"]:
        pytest.skip("run together with the property test")
    assert _outcomes["valid"] > 0 and _outcomes["rejected"] > 0, _outcomes


# -- odd kv_transfer_params: a request is never refused, a rule never crashes ------------------
ODD_PARAMS = [
    None,
    {},
    [],
    0,
    "",
    False,
    "persist",
    ["persist"],
    5,
    2.5,
    b"persist",
    ("persist", True),
    {"persist": None},
    {"persist": [True]},
    {"persist": {"a": {"b": [1, None]}}},
    {"persist": float("nan")},
    {"tenant": 7},
    {"tenant": {"x": [1]}},
    {"tenant": ["a"]},
    {"tenant": True},
    {1: 2, "persist": "yes"},
    {"persist": object()},
]


class _Weird:
    def __eq__(self, other):
        raise RuntimeError("no comparing me")

    __hash__ = object.__hash__


@pytest.mark.parametrize("params", [*ODD_PARAMS, {"persist": _Weird()}], ids=repr)
def test_odd_request_params_never_break_policy_decisions(params) -> None:
    rules = [
        PolicyRule.from_dict({"tier": "fs", "match": {"kv_transfer_params": {"persist": True}}}),
        PolicyRule.from_dict({"tier": "*", "match": {"tenant": "acme"}}),
    ]
    req = ReqContext("r", kv_transfer_params=params)
    ctx = decide(rules, "fs", req)
    assert ctx.policy is OffloadPolicy.CHUNK_LEVEL  # none of them says persist: True, or tenant acme
    tenant = request_tenant(req)
    assert tenant is None or isinstance(tenant, str)
    normalised = request_params(params)
    assert normalised is None or isinstance(normalised, dict)


def test_matching_params_still_match() -> None:
    rules = [
        PolicyRule.from_dict({"tier": "fs", "match": {"kv_transfer_params": {"persist": True}}}),
        PolicyRule.from_dict({"tier": "object_store", "match": {"tenant": "7"}}),
    ]
    assert decide(rules, "fs", ReqContext("r", {"persist": True, "x": [1]})).policy is OffloadPolicy.REQUEST_LEVEL
    assert decide(rules, "object_store", ReqContext("r", {"tenant": 7})).policy is OffloadPolicy.REQUEST_LEVEL

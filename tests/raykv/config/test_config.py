"""Config validation: every error names the field and what is allowed."""

from __future__ import annotations

import pytest

from raykv.config.options import RaykvConfig
from raykv.core.contract import OffloadPolicy
from raykv.core.factory import TierFactory, validate_tier_config
from raykv.core.validate import ConfigError


def test_defaults_roundtrip():
    cfg = RaykvConfig.from_dict({})
    assert cfg.namespace == "raykv" and cfg.directory_shards >= 1
    assert RaykvConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "raw, field, words",
    [
        ({"shards": 2}, "shards", "did you mean 'directory_shards'? allowed keys: agent_"),
        ({"directory_shards": 0}, "directory_shards", ">= 1"),
        ({"directory_shards": "2"}, "directory_shards", "must be int"),
        ({"directory_shards": True}, "directory_shards", "must be int"),
        ({"namespace": "has space"}, "namespace", "letters, digits"),
        ({"tiers": [{"type": "nope"}]}, "tiers[0].type", "known types: example, example_node, fs, object_store"),
        (
            {"rules": [{"tier": "fs", "policy": "sometimes"}]},
            "rules[0].policy",
            "request_level, chunk_level, block_level",
        ),
        ({"rules": [{"tier": "fs", "match": {"user": "x"}}]}, "rules[0].match.user", "tenant, kv_transfer_params"),
    ],
)
def test_raykv_config_errors(raw, field, words):
    with pytest.raises(ConfigError) as e:
        RaykvConfig.from_dict(raw)
    assert e.value.field == field
    assert words in str(e.value)


def test_unknown_tier_type_lists_known_types():
    with pytest.raises(
        ConfigError, match=r"unknown tier type 'redis'; known types: example, example_node, fs, object_store"
    ):
        TierFactory.get_tier_class({"type": "redis"}, "secondary_tiers[0]")


def test_missing_type():
    with pytest.raises(ConfigError, match=r"secondary_tiers\[2\]\.type: required"):
        TierFactory.get_tier_class({"root": "/x"}, "secondary_tiers[2]")


def test_bad_module_path_names_module_and_class():
    with pytest.raises(ConfigError) as e:
        TierFactory.get_tier_class({"type": "MyTier", "module_path": "no_such_pkg.tiers"}, "t")
    assert e.value.field == "t.module_path"
    assert "no_such_pkg.tiers" in str(e.value) and "MyTier" in str(e.value)


def test_module_path_without_that_class():
    with pytest.raises(ConfigError, match=r"module 'tiers.example' has no tier class 'Nope'"):
        TierFactory.get_tier_class({"type": "Nope", "module_path": "tiers.example"})


def test_module_path_class_must_be_a_tier():
    with pytest.raises(ConfigError, match="not a raykv.core.contract.SecondaryTier subclass"):
        TierFactory.get_tier_class({"type": "RaykvConfig", "module_path": "raykv.config.options"})


def test_out_of_tree_tier_by_module_path():
    cls = TierFactory.get_tier_class({"type": "ExampleTier", "module_path": "tiers.example.tier"})
    assert cls.__name__ == "ExampleTier"


def test_tier_option_errors():
    with pytest.raises(ConfigError) as e:
        validate_tier_config({"type": "example", "capacity_blocks": -1}, "secondary_tiers[0]")
    assert e.value.field == "secondary_tiers[0].capacity_blocks" and ">= 0" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate_tier_config({"type": "example", "colour": "red"}, "secondary_tiers[0]")
    assert e.value.field == "secondary_tiers[0].colour"
    assert "allowed keys: capacity_blocks, max_pinned_fraction, request_level" in str(e.value)


def test_fs_tier_needs_root_and_nonnegative_capacity():
    with pytest.raises(ConfigError) as e:
        validate_tier_config({"type": "fs"}, "tiers[0]")
    assert e.value.field == "tiers[0].root"
    with pytest.raises(ConfigError) as e:
        validate_tier_config({"type": "fs", "root": "/tmp/x", "capacity_bytes": -5}, "tiers[0]")
    assert e.value.field == "tiers[0].capacity_bytes" and ">= 0" in str(e.value)


def test_object_store_capacity_must_be_nonnegative():
    with pytest.raises(ConfigError) as e:
        validate_tier_config({"type": "object_store", "capacity_bytes": -1}, "tiers[1]")
    assert e.value.field == "tiers[1].capacity_bytes"


def test_policy_aliases():
    assert OffloadPolicy.parse("block_level") is OffloadPolicy.CHUNK_LEVEL
    assert OffloadPolicy.parse("BLOCK_LEVEL") is OffloadPolicy.CHUNK_LEVEL
    assert OffloadPolicy.BLOCK_LEVEL is OffloadPolicy.CHUNK_LEVEL
    assert OffloadPolicy.parse("REQUEST_LEVEL") is OffloadPolicy.REQUEST_LEVEL
    with pytest.raises(ValueError, match="allowed: chunk_level, block_level, request_level"):
        OffloadPolicy.parse("whole")

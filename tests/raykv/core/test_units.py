"""Sizes read from configs and the command line (``raykv.core.units.parse_size``), and the
options in bytes that take them."""

from __future__ import annotations

import pytest

from raykv.config.options import RaykvConfig
from raykv.core.factory import validate_tier_config
from raykv.core.units import fmt_bytes, parse_size
from raykv.core.validate import ConfigError


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("65536", 65536),
        ("0", 0),
        ("64GiB", 64 << 30),
        ("64 GiB", 64 << 30),
        ("64gib", 64 << 30),
        ("64Gi", 64 << 30),  # Kubernetes' spelling
        ("1.5GiB", 3 << 29),
        (".5KiB", 512),
        ("2KB", 2000),
        ("3 TB", 3 * 10**12),
        ("512B", 512),
        ("1e9", 10**9),  # what YAML 1.1 leaves a string
        ("1.5e3KB", 1_500_000),
        (" 8MiB ", 8 << 20),
    ],
)
def test_sizes_read_as_bytes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("4G", "ambiguous: write GiB or GB"),
        ("4k", "ambiguous: write KiB or KB"),
        ("12 parsecs", "unknown size unit 'parsecs'"),
        ("1.5B", "whole number of bytes"),
        ("1e-1KiB", "whole number of bytes"),
        ("-1GiB", "must be a size such as"),
        ("GiB", "must be a size such as"),
        ("", "must be a size such as"),
        ("1e999999", "must be a size such as"),  # never a huge power of ten
        ("9" * 100, "must be a size such as"),
    ],
)
def test_bad_sizes_say_why(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_size(text)


def test_fmt_bytes_reads_back() -> None:
    assert parse_size(fmt_bytes(3 << 20).replace(" ", "")) == 3 << 20


def test_byte_options_take_sizes_and_give_ints() -> None:
    fs = validate_tier_config(
        {"type": "fs", "root": "/tmp/x", "capacity_bytes": "64GiB", "tenant_quotas": {"a": "1GiB", "*": 4096}}
    )
    assert fs.capacity_bytes == 64 << 30 and type(fs.capacity_bytes) is int
    assert fs.tenant_quotas == {"a": 1 << 30, "*": 4096}
    store = validate_tier_config(
        {"type": "object_store", "capacity_bytes": 1e9, "max_pack_bytes": "8MiB", "piece_bytes": "1MiB"}
    )
    assert (store.capacity_bytes, store.max_pack_bytes, store.piece_bytes) == (10**9, 8 << 20, 1 << 20)
    # the whole config (raykv.start's and the CLI's check) takes them too
    RaykvConfig.from_dict({"tiers": [{"type": "object_store", "capacity_bytes": "512MiB"}]})


@pytest.mark.parametrize(
    ("tier", "field", "says"),
    [
        ({"type": "object_store", "capacity_bytes": "4G"}, "capacity_bytes", "ambiguous"),
        ({"type": "object_store", "capacity_bytes": 1.5}, "capacity_bytes", "whole number of bytes"),
        ({"type": "object_store", "capacity_bytes": float("nan")}, "capacity_bytes", "whole number of bytes"),
        ({"type": "object_store", "capacity_bytes": "-1MiB"}, "capacity_bytes", "must be a size"),
        ({"type": "object_store", "piece_bytes": "1KiB"}, "piece_bytes", ">= 4096"),
        ({"type": "fs", "root": "/tmp/x", "tenant_quotas": {"a": "lots"}}, "tenant_quotas", "tenant 'a'"),
        ({"type": "fs", "root": "/tmp/x", "tenant_quotas": {"a": "0B"}}, "tenant_quotas", "int >= 1"),
    ],
)
def test_bad_byte_options_name_the_field(tier: dict, field: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        RaykvConfig.from_dict({"tiers": [tier]})
    assert e.value.field == f"tiers[0].{field}"

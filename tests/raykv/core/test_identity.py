import pytest

from raykv.core.identity import DEFAULT_IDENTITY, TAG_BYTES, KVIdentity, key_tag, scope_key, unscope_key
from raykv.core.validate import ConfigError


def test_every_field_changes_the_tag():
    base = KVIdentity(model="m", revision="r1", weights="w", layout={"dtype": "bf16", "tp": 1, "rank": 0})
    variants = [
        KVIdentity(model="m2", revision="r1", weights="w", layout=base.layout),
        KVIdentity(model="m", revision="r2", weights="w", layout=base.layout),
        KVIdentity(model="m", revision="r1", weights="w2", layout=base.layout),
        KVIdentity(model="m", revision="r1", weights="w", layout={**base.layout, "dtype": "fp16"}),
        KVIdentity(model="m", revision="r1", weights="w", layout={**base.layout, "tp": 2}),
        KVIdentity(model="m", revision="r1", weights="w", layout={**base.layout, "rank": 1}),
    ]
    tags = {base.tag, *(v.tag for v in variants)}
    assert len(tags) == 1 + len(variants)
    assert all(len(t) == TAG_BYTES for t in tags)
    # equal fields, equal tag (layout order does not matter)
    same = KVIdentity(model="m", revision="r1", weights="w", layout={"rank": 0, "tp": 1, "dtype": "bf16"})
    assert same.tag == base.tag


def test_scoped_key_round_trip():
    tag = KVIdentity(model="m").tag
    key = b"\x01" * 36
    scoped = scope_key(tag, key)
    assert key_tag(scoped) == tag and unscope_key(scoped) == key
    assert DEFAULT_IDENTITY.tag != tag


def test_from_dict_validates():
    assert KVIdentity.from_dict(None) == DEFAULT_IDENTITY
    ident = KVIdentity.from_dict({"model": "m", "revision": "r", "layout": {"dtype": "bf16"}})
    assert KVIdentity.from_dict(ident.to_dict()) == ident
    with pytest.raises(ConfigError, match=r"identity\.colour: unknown key"):
        KVIdentity.from_dict({"model": "m", "colour": 1})
    with pytest.raises(ConfigError, match=r"identity\.revision: must be str"):
        KVIdentity.from_dict({"model": "m", "revision": 3})
    with pytest.raises(ConfigError, match=r"identity: must be a mapping"):
        KVIdentity.from_dict(["m"])


def test_layout_ints_are_read_checked():
    ident = KVIdentity(model="m", layout={"tokens_per_hash": 16, "dtype": "bf16"})
    assert ident.layout_int("tokens_per_hash") == 16
    assert ident.layout_int("blocks_per_chunk", 1) == 1
    with pytest.raises(ValueError, match="layout\\['dtype'\\] must be an int"):
        ident.layout_int("dtype")
    with pytest.raises(ValueError, match="layout\\['tp'\\] must be an int, got None"):
        ident.layout_int("tp")


def test_the_label_tells_apart_two_identities_of_the_same_files():
    layout = {"dtype": "bfloat16", "tp": 1, "pp": 1, "rank": 0}
    plain = KVIdentity(model="/m", layout={**layout, "engine_config": {"quantization": None, "hf_config": "ab" * 16}})
    quant = KVIdentity(model="/m", layout={**layout, "engine_config": {"quantization": "fp8", "hf_config": "cd" * 16}})
    assert plain.label() == "/m dtype=bfloat16 tp=1 pp=1 rank=0 config=abababab"
    assert quant.label() == "/m dtype=bfloat16 tp=1 pp=1 rank=0 quantization=fp8 config=cdcdcdcd"
    assert KVIdentity(model="/m", layout={**layout, "engine_config": "unknown"}).label() == (
        "/m dtype=bfloat16 tp=1 pp=1 rank=0"
    )

"""KV identity: what makes two engines' offload keys name the same bytes.

vLLM's block hashes cover tokens, ``cache_salt``, LoRA and multimodal extras,
but not the model: a base model and its fine-tune, or one model at two
parallel layouts, give equal hashes for different KV. raykv therefore scopes
every key it stores or looks up with an 8-byte **tag** of the engine's
identity (the fields vLLM's own fs tier hashes into its folder names, plus a
weights revision): a scoped key is ``tag + offload key``. Engines of different
identities never see each other's blocks; invalidating an identity drops every
key that starts with its tag.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from raykv.core.validate import ConfigError, is_int
from raykv.core.wire import JsonValue, Report

#: Length of an identity tag, the first bytes of every scoped key.
TAG_BYTES = 8


@dataclass(frozen=True)
class KVIdentity:
    """The fields that decide a KV block's bytes for one engine.

    ``model`` is the model name or path as the engine loaded it; ``revision``
    a weights revision (explicit, or the hub revision); ``weights`` a
    fingerprint of the weight files (``raykv.integrations.vllm.identity``).
    ``layout`` holds the parallel layout and KV layout fields (dtype, tokens
    per chunk, KV cache groups, tp/pp/... sizes and rank, canonical format).
    """

    model: str = "default"
    revision: str = ""
    weights: str = ""
    layout: Mapping[str, JsonValue] = field(default_factory=dict)

    @property
    def tag(self) -> bytes:
        """8-byte digest of every field (the prefix of this identity's keys)."""
        return hashlib.blake2b(self.canonical().encode(), digest_size=TAG_BYTES).digest()

    @property
    def tag_hex(self) -> str:
        return self.tag.hex()

    def canonical(self) -> str:
        """Stable JSON of every field (what the tag hashes)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), default=str)

    def to_dict(self) -> Report:
        """Every field, as JSON (for status pages and files; ``from_dict`` reads it back)."""
        out: Report = asdict(self)
        out["layout"] = dict(self.layout)
        return out

    def layout_int(self, name: str, default: int | None = None) -> int:
        """``layout[name]`` as an int (``default`` when absent); ``ValueError`` when it is not one."""
        value = self.layout.get(name, default)
        if not is_int(value):
            raise ValueError(f"identity {self.label()!r}: layout[{name!r}] must be an int, got {value!r}")
        return int(value)

    @classmethod
    def from_dict(cls, raw: object, where: str = "identity") -> KVIdentity:
        """Build from a mapping (``model``, ``revision``, ``weights``, ``layout``);
        an identity is returned as it is, None is ``DEFAULT_IDENTITY``."""
        if raw is None:
            return DEFAULT_IDENTITY
        if isinstance(raw, KVIdentity):
            return raw
        if not isinstance(raw, Mapping):
            raise ConfigError(where, f"must be a mapping of model, revision, weights, layout; got {type(raw).__name__}")
        unknown = sorted(set(raw) - {"model", "revision", "weights", "layout"})
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", "unknown key; allowed keys: layout, model, revision, weights")
        for name in ("model", "revision", "weights"):
            if name in raw and not isinstance(raw[name], str):
                raise ConfigError(f"{where}.{name}", f"must be str, got {type(raw[name]).__name__}")
        if not raw.get("model", "default"):
            raise ConfigError(f"{where}.model", "must be a non-empty str")
        layout = raw.get("layout", {})
        if not isinstance(layout, Mapping):
            raise ConfigError(f"{where}.layout", f"must be a mapping, got {type(layout).__name__}")
        return cls(
            model=raw.get("model", "default"),
            revision=raw.get("revision", ""),
            weights=raw.get("weights", ""),
            layout=dict(layout),
        )

    def label(self) -> str:
        """A short human name: ``model@revision`` plus the layout's key fields."""
        name = self.model + (f"@{self.revision}" if self.revision else "")
        bits = [f"{k}={self.layout[k]}" for k in ("dtype", "tp", "pp", "rank") if k in self.layout]
        engine = self.layout.get("engine_config")
        if isinstance(engine, Mapping):  # what tells two engines of the same files apart
            if engine.get("quantization"):
                bits.append(f"quantization={engine['quantization']}")
            if engine.get("hf_config"):
                bits.append(f"config={str(engine['hf_config'])[:8]}")
        return " ".join([name, *bits])


#: The identity of tiers built without one (raykv's own API, tests, tools).
DEFAULT_IDENTITY = KVIdentity()


def scope_key(tag: bytes, key: bytes) -> bytes:
    """The key raykv stores for ``key`` under identity ``tag``."""
    return tag + key


def unscope_key(scoped: bytes) -> bytes:
    """The engine's own key inside a scoped key."""
    return scoped[TAG_BYTES:]


def key_tag(scoped: bytes) -> bytes:
    """The identity tag a scoped key starts with."""
    return scoped[:TAG_BYTES]


def blocks_by_identity(keys: Iterable[bytes]) -> dict[str, int]:
    """Held blocks per identity tag (hex), for status pages."""
    return dict(Counter(k[:TAG_BYTES].hex() for k in keys))


def scoped_keys(keys: Iterable[bytes], identity: KVIdentity = DEFAULT_IDENTITY) -> list[bytes]:
    """``keys`` as raykv stores them for ``identity`` (what the directory and
    the tier actors list): for tools that talk to those directly."""
    tag = identity.tag
    return [tag + bytes(k) for k in keys]

"""Reading a raykv config file (YAML or JSON) into a config tree.

Every problem with the file itself (missing, unreadable, not UTF-8, a syntax
error, duplicate keys, a top level that is not a mapping) is a one-line
``ConfigError`` naming the file; the tree's fields are checked afterwards by
``RaykvConfig.from_dict``.
"""

from __future__ import annotations

import json
import os
from typing import NoReturn

from raykv.core.validate import ConfigError, type_name

#: Larger than any sane config: refuse before reading a wrong file whole.
MAX_CONFIG_BYTES = 16 << 20


def load_config_file(path: str) -> dict[str, object]:
    """The mapping in ``path`` (``.json``: JSON; otherwise YAML, which also reads JSON)."""
    where = f"config file {path!r}"
    if not isinstance(path, str) or not path:
        raise ConfigError("--config", f"must be a file path, got {path!r}")
    try:
        if os.path.isdir(path):
            raise ConfigError(where, "is a directory, not a file")
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise ConfigError(where, f"is larger than {MAX_CONFIG_BYTES >> 20} MiB; is it the right file?")
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(where, "no such file") from None
    except OSError as e:
        raise ConfigError(where, f"cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(where, f"is not UTF-8 text (byte {e.start}); is it a YAML or JSON file?") from None
    raw = _parse_json(text, where) if path.endswith(".json") else _parse_yaml(text, where)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            where, f"must hold a mapping (namespace:, tiers:, ...) at its top level, got {type_name(raw)}"
        )
    return raw


def _parse_json(text: str, where: str) -> object:
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in pairs:
            if k in out:
                raise ConfigError(where, f"key {k!r} appears twice in one object")
            out[k] = v
        return out

    def no_constant(name: str) -> NoReturn:
        raise ConfigError(where, f"{name} is not a JSON number")

    if not text.strip():
        return None
    try:
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(where, f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(where, "nested too deeply") from None


def _parse_yaml(text: str, where: str) -> object:
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping."""

    def construct_mapping(loader: Loader, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        loader.flatten_mapping(node)
        out: dict[object, object] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise ConfigError(
                    where, f"line {key_node.start_mark.line + 1}: a mapping key must be a scalar"
                ) from None
            if key in out:
                raise ConfigError(
                    where, f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in one mapping"
                )
            out[key] = loader.construct_object(value_node, deep=deep)
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(where, f"invalid YAML{at}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(where, f"invalid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    except RecursionError:
        raise ConfigError(where, "nested too deeply") from None

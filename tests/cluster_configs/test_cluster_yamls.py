"""The ``ray up`` YAMLs in cluster_configs/ validate against the installed Ray's schema."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
import yaml

from raykv.config.options import RaykvConfig
from raykv.core.factory import validate_tier_config

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"
SCHEMA_PATH = Path(ray.autoscaler.__file__).parent / "ray-schema.json"


def _kind(doc: Any) -> str:
    """What a YAML in cluster_configs/ is. Anything not recognised is a cluster YAML."""
    if isinstance(doc, dict) and "applications" in doc:
        return "serve"  # a Ray Serve config (serve run / serve deploy)
    if isinstance(doc, dict) and "tiers" in doc and "provider" not in doc:
        return "raykv"
    return "cluster"


def _yamls() -> dict[str, Any]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(CONFIGS.glob("*.y*ml"))}


def _cluster_yamls() -> dict[str, dict[str, Any]]:
    return {n: d for n, d in _yamls().items() if _kind(d) == "cluster"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def test_there_is_an_aws_and_an_onprem_cluster_yaml() -> None:
    providers = {d["provider"]["type"] for d in _cluster_yamls().values()}
    assert {"aws", "local"} <= providers


@pytest.mark.parametrize("name", sorted(_cluster_yamls()))
def test_cluster_yaml_validates_against_ray_schema(name: str, schema: dict[str, Any]) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    doc = _cluster_yamls()[name]
    jsonschema.validate(doc, schema)
    # What `ray up` does before launching anything: fill defaults, validate again.
    validate_config(prepare_config(copy.deepcopy(doc)))


def _commands(doc: dict[str, Any], *fields: str) -> list[str]:
    out: list[str] = []
    for f in fields:
        out += doc.get(f) or []
        for node_type in (doc.get("available_node_types") or {}).values():
            out += node_type.get(f) or []
    return out


def _raykv_config_of(doc: dict[str, Any], command: str) -> Path:
    """The repository file that ``raykv start --config <remote path>`` reads (via file_mounts)."""
    remote = shlex.split(command)[shlex.split(command).index("--config") + 1]
    for dst, src in doc.get("file_mounts", {}).items():
        if remote == dst:
            return CONFIGS.parent / src
        if remote.startswith(dst.rstrip("/") + "/"):
            return CONFIGS.parent / src / remote[len(dst.rstrip("/")) + 1 :]
    raise AssertionError(f"{remote} is not under any file_mounts target")


@pytest.mark.parametrize("name", sorted(_cluster_yamls()))
def test_cluster_yaml_installs_mounts_sizes_and_starts_raykv(name: str) -> None:
    doc = _cluster_yamls()[name]
    setup = _commands(doc, "initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
    assert any(re.search(r"pip install .*raykv", c) for c in setup), "raykv is not installed"

    head = doc["head_start_ray_commands"]
    workers = doc["worker_start_ray_commands"]
    starts = [c for c in head + workers if "ray start" in c]
    assert starts and all("--object-store-memory=" in c for c in starts), "an object store is not sized"
    ray_at = next(i for i, c in enumerate(head) if "ray start" in c)
    raykv_at = [i for i, c in enumerate(head) if c.startswith("raykv start")]
    assert raykv_at and raykv_at[0] > ray_at, "raykv must start after Ray on the head"

    config_path = _raykv_config_of(doc, head[raykv_at[0]])
    assert config_path.is_file(), config_path
    cfg = RaykvConfig.from_dict(yaml.safe_load(config_path.read_text()))
    tiers = {t["type"]: t for t in cfg.tiers}
    # The fs tier's root is the shared filesystem the setup commands mount.
    root = tiers["fs"]["root"]
    assert any(re.search(rf"mount .*\s{re.escape(root)}(\s|\)|$)", c) for c in setup), f"{root} is not mounted"
    # The object store tier fits in every node's object store (it caps itself at 80%).
    sizes = [int(re.search(r"--object-store-memory=(\d+)", c).group(1)) for c in starts]
    capacity = validate_tier_config(tiers["object_store"]).capacity_bytes  # an int, or a size such as "48GiB"
    assert capacity <= 0.8 * max(sizes)


def test_raykv_config_files_validate() -> None:
    raykv_docs = {n: d for n, d in _yamls().items() if _kind(d) == "raykv"}
    assert raykv_docs
    for doc in raykv_docs.values():
        RaykvConfig.from_dict(doc)


def test_broken_cluster_yaml_is_rejected_with_the_schema_message(schema: dict[str, Any]) -> None:
    from ray.autoscaler._private.util import validate_config

    doc = copy.deepcopy(_cluster_yamls()["onprem.yaml"])
    doc["min_workers"] = 2  # a top-level key the schema does not allow (it is per node type)
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(doc, schema)
    assert err.value.message == "Additional properties are not allowed ('min_workers' was unexpected)"
    assert err.value.validator == "additionalProperties"

    doc = copy.deepcopy(_cluster_yamls()["aws.yaml"])
    doc["max_workers"] = "four"
    with pytest.raises(jsonschema.ValidationError) as err:
        validate_config(doc)  # Ray's own check (what `ray up` runs) reports the same schema message
    assert err.value.message == "'four' is not of type 'integer'"
    assert list(err.value.absolute_path) == ["max_workers"]

    del doc["provider"]
    with pytest.raises(jsonschema.ValidationError, match="'provider' is a required property"):
        jsonschema.validate(doc, schema)


def test_serve_config_uses_the_clusters_fs_root() -> None:
    """The engines' fs tier (serve_llm.yaml) writes where `raykv start` (raykv.yaml) put the fs root:
    the shared mount of the cluster YAMLs."""
    serve = yaml.safe_load((CONFIGS / "serve_llm.yaml").read_text())
    cluster = yaml.safe_load((CONFIGS / "raykv.yaml").read_text())
    fs_root = next(t["root"] for t in cluster["tiers"] if t["type"] == "fs")
    for app in serve["applications"]:
        roots = [t["root"] for t in app["args"]["raykv"]["tiers"] if t["type"] == "fs"]
        assert roots == [fs_root], (app["name"], roots, fs_root)

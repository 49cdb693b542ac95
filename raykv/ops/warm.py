"""``raykv warm``: compute prefixes once on a Serve app and pin them cluster-wide.

For each prompt, one ``/v1/completions`` request to the app's OpenAI-compatible
endpoint, ``max_tokens: 1``, with ``kv_transfer_params: {"cache_ttl_s": ttl,
"tenant": ...}``: one replica computes the prefix, and its engine stores the
prompt's full blocks in the tiers its policy chooses, pinned for ``ttl``
seconds (``raykv.core.pins``). The engine stores after the request answered,
so ``warm`` then waits until the tiers' pinned blocks stop growing
(``pin_watch``) and reports the increase per tier actor.

The prompts go one at a time (each computes on one replica; a prompt sharing
another's prefix then finds it cached). A tenant scopes the keys: later
requests find the pinned prefix only with the same ``tenant``. A prefix the
engine already holds in its own cache is not stored again, and one already
pinned in the tiers only has its pin extended: neither shows as an increase.
The increase counts every pin made meanwhile, other traffic's too.

With ``all_nodes`` (``--all-nodes``), warm then puts a copy of the pinned
blocks in every node's object store, for prefixes every replica will need
(``tiers.object_store.all_nodes``): it asks the object store actors for the
keys they hold pinned for the tenant that last about as long as the pins
warm made (``--ttl`` less the time warm took), and every alive node's actor
pulls those it lacks from the holders and stores them as its own, pinned for
``--ttl``. Each replica's first request with the prefix then loads it from
its own node. Keys pinned for the same tenant by other traffic with a pin
lasting as long are copied too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import requests

from raykv.core.errors import RaykvError
from raykv.core.units import fmt_bytes
from raykv.core.validate import MAX_CACHE_TTL_S, ConfigError
from raykv.core.wire import JsonValue, Report
from raykv.ops.pin_watch import NOTHING_NEW, PinCount, Settling, growth, read_pins, wait_settled
from raykv.ops.prompt_file import Prompt
from raykv.services.cluster import RaykvServices
from tiers.object_store.all_nodes import Replication, replicate_pinned
from tiers.object_store.messages import TIER_TYPE as OBJECT_STORE

DEFAULT_URL = "http://127.0.0.1:8000"
#: Seconds taken off the pins' time left when ``--all-nodes`` asks for warm's own
#: pins (the ask reaches the actors that much after warm measured its time).
PIN_AGE_SLACK_S = 5.0


@dataclass(frozen=True)
class Answered:
    """One warm request's answer: prompt tokens, tokens the app found cached, seconds."""

    prompt_tokens: int
    cached_tokens: int
    seconds: float


@dataclass
class Warmed:
    """What ``warm`` did: the requests' answers and the pins they added per tier actor."""

    model: str
    ttl_s: float
    tenant: str | None
    answers: list[Answered] = field(default_factory=list)
    #: Blocks and bytes pinned meanwhile, per tier actor (holder id).
    pinned: dict[str, PinCount] = field(default_factory=dict)
    #: How the wait for the stores ended (``pin_watch``: settled, nothing new pinned, timed out).
    ended: str = ""
    #: With ``--all-nodes``: the copies of the pinned blocks made on every node.
    replicated: Replication | None = None

    @property
    def blocks_pinned(self) -> int:
        return sum(p.blocks for p in self.pinned.values())

    @property
    def bytes_pinned(self) -> int:
        return sum(p.nbytes for p in self.pinned.values())

    def per_tier(self) -> dict[str, tuple[int, int]]:
        """Tier type -> (blocks, bytes) pinned, over its actors."""
        out: dict[str, tuple[int, int]] = {}
        for p in self.pinned.values():
            blocks, nbytes = out.get(p.tier_type, (0, 0))
            out[p.tier_type] = (blocks + p.blocks, nbytes + p.nbytes)
        return out

    def report(self) -> Report:
        """As one JSON object (``raykv warm --json``)."""
        holders: list[JsonValue] = [
            {
                "holder_id": p.holder_id,
                "tier_type": p.tier_type,
                "node_id": p.node_id,
                "blocks": p.blocks,
                "bytes": p.nbytes,
            }
            for p in sorted(self.pinned.values(), key=lambda p: p.holder_id)
        ]
        tiers: Report = {t: {"blocks": b, "bytes": n} for t, (b, n) in sorted(self.per_tier().items())}
        prompts: list[JsonValue] = [
            {"prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens, "seconds": round(a.seconds, 3)}
            for a in self.answers
        ]
        return {
            "model": self.model,
            "ttl_s": self.ttl_s,
            "tenant": self.tenant,
            "prompts": prompts,
            "blocks_pinned": self.blocks_pinned,
            "bytes_pinned": self.bytes_pinned,
            "per_tier": tiers,
            "per_holder": holders,
            "ended": self.ended,
            "all_nodes": self.replicated.report() if self.replicated is not None else None,
        }

    def format(self) -> str:
        """As plain text (``raykv warm``)."""
        tokens = sum(a.prompt_tokens for a in self.answers)
        who = f", tenant {self.tenant!r}" if self.tenant is not None else ""
        lines = [
            f"warmed {len(self.answers)} prompts ({tokens} tokens) on {self.model}, ttl {self.ttl_s:g} s{who}: "
            f"{self.blocks_pinned} blocks, {fmt_bytes(self.bytes_pinned)} newly pinned ({self.ended})"
        ]
        for tier, (blocks, nbytes) in sorted(self.per_tier().items()):
            lines.append(f"  {tier:<13} {blocks:>7} blocks {fmt_bytes(nbytes):>10}")
        for p in sorted(self.pinned.values(), key=lambda p: p.holder_id):
            lines.append(f"    {p.holder_id:<40} {p.blocks:>7} blocks {fmt_bytes(p.nbytes):>10}")
        if self.ended == NOTHING_NEW:
            lines.append(
                "  (no new pins: the prefixes may be pinned already, held in the engines' own caches, "
                "shorter than one block, or no tier of the app keeps pins)"
            )
        if self.replicated is not None:
            lines += _format_replication(self.replicated)
        return "\n".join(lines)


def _format_replication(r: Replication) -> list[str]:
    """The ``--all-nodes`` lines of ``Warmed.format``."""
    lines = [
        f"  all nodes: {r.keys} pinned blocks sent to {len(r.per_node) + len(r.errors)} nodes' object stores; "
        f"{r.copied} blocks, {fmt_bytes(r.copied_bytes)} copied"
    ]
    for node_id, a in sorted(r.per_node.items()):
        refused = "".join(f", pin refused ({why}) {n}" for why, n in sorted(a.pins_refused.items()) if n)
        not_stored = f", not stored {a.not_stored} ({a.error})" if a.not_stored else ""
        lines.append(
            f"    node {node_id[:12]}: copied {a.copied} ({fmt_bytes(a.copied_bytes)}), already there {a.held}, "
            f"not found {a.not_found}{not_stored}{refused}"
        )
    for node_id, why in sorted(r.errors.items()):
        lines.append(f"    node {node_id[:12]}: not reached ({why})")
    if not r.keys:
        lines.append("  (no pinned blocks of this warm found in any object store: nothing copied)")
    return lines


def check_ttl(ttl_s: float) -> float:
    """``ttl_s`` as a pin lifetime: a finite number of seconds > 0, at most 7 days (``ConfigError``)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ConfigError("--ttl", f"must be a number of seconds > 0, got {ttl_s!r}")
    if ttl_s > MAX_CACHE_TTL_S:
        raise ConfigError("--ttl", f"at most {MAX_CACHE_TTL_S:.0f} s (7 days), got {ttl_s:g}")
    return float(ttl_s)


def _http(method: str, url: str, timeout: float, body: Report | None = None) -> Report:
    """One HTTP call to the app; its JSON answer, or ``RaykvError`` in one line."""
    try:
        r = requests.request(method, url, json=body, timeout=timeout)
    except requests.RequestException as e:
        raise RaykvError(f"cannot reach the Serve app at {url}: {type(e).__name__}: {e}") from None
    if not r.ok:
        raise RaykvError(f"{url} answered HTTP {r.status_code}: {' '.join(r.text.split())[:300]}")
    try:
        answer = r.json()
    except ValueError:
        raise RaykvError(f"{url} answered no JSON: {' '.join(r.text.split())[:300]}") from None
    if not isinstance(answer, dict):
        raise RaykvError(f"{url} answered {type(answer).__name__}, not a JSON object")
    return answer


def app_model(url: str, model: str | None = None, timeout: float = 30.0) -> str:
    """The model to warm on the app at ``url`` (its ``/v1/models``): ``model`` when the
    app serves it, else the app's one model. ``RaykvError`` when the app does not
    answer; ``ConfigError`` when ``model`` is not served or the app serves several."""
    data = _http("GET", f"{url.rstrip('/')}/v1/models", timeout).get("data")
    ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    if model is not None:
        if model not in ids:
            raise ConfigError("--model", f"{url} serves no model {model!r} (it serves {ids!r})")
        return model
    if len(ids) != 1 or not isinstance(ids[0], str):
        raise ConfigError("--model", f"name the model to warm; {url} serves {ids!r}")
    return ids[0]


def complete(
    url: str, model: str, prompt: Prompt, ttl_s: float, tenant: str | None, timeout: float = 600.0
) -> Answered:
    """One pinning request of ``prompt`` (``max_tokens: 1``) to the app at ``url``."""
    params: Report = {"cache_ttl_s": ttl_s, **({"tenant": tenant} if tenant is not None else {})}
    body: Report = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": params,
    }
    t0 = time.perf_counter()
    answer = _http("POST", f"{url.rstrip('/')}/v1/completions", timeout, body)
    usage = answer.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt_tokens = usage.get("prompt_tokens")
    return Answered(
        int(prompt_tokens) if isinstance(prompt_tokens, int) else 0,
        int(cached) if isinstance(cached, int) else 0,
        time.perf_counter() - t0,
    )


def warm(
    services: RaykvServices,
    prompts: Sequence[Prompt],
    ttl_s: float,
    *,
    url: str = DEFAULT_URL,
    model: str | None = None,
    tenant: str | None = None,
    request_timeout_s: float = 600.0,
    settling: Settling | None = None,
    all_nodes: bool = False,
) -> Warmed:
    """Compute each of ``prompts`` once on the Serve app at ``url`` (serving ``model``;
    default: its one model), pinned for ``ttl_s`` seconds for ``tenant``, and wait
    until the tiers of ``services``' namespace have stored the blocks; with
    ``all_nodes``, then copy the pinned blocks into every node's object store
    (``Warmed.replicated``). ``ConfigError`` for bad input, ``RaykvError`` when
    the app or the tiers cannot be reached (or, with ``all_nodes``, there is no
    object store tier actor)."""
    ttl_s = check_ttl(ttl_s)
    if not prompts:
        raise ConfigError("prompts", "none to warm")
    model = app_model(url, model)
    before = read_pins(services)
    if not before:
        raise RaykvError(
            f"no tier actor that keeps pins (object_store, fs) in raykv namespace {services.namespace!r}: "
            "is the app's raykv namespace this one, and have its replicas started?"
        )
    if all_nodes and not any(p.tier_type == OBJECT_STORE for p in before.values()):
        raise RaykvError(
            f"--all-nodes copies pinned blocks between the nodes' object stores, but raykv namespace "
            f"{services.namespace!r} has no object_store tier actor: does the app's config have an "
            "object_store tier, and have its replicas started?"
        )
    out = Warmed(model, ttl_s, tenant)
    t0 = time.monotonic()
    for prompt in prompts:
        out.answers.append(complete(url, model, prompt, ttl_s, tenant, request_timeout_s))
    after, out.ended = wait_settled(lambda: read_pins(services), before, settling or Settling())
    out.pinned = growth(before, after)
    if all_nodes:
        lasting = ttl_s - (time.monotonic() - t0) - PIN_AGE_SLACK_S
        try:
            out.replicated = replicate_pinned(services.holders(), services.namespace, tenant, ttl_s, lasting)
        except RuntimeError as e:
            raise RaykvError(f"--all-nodes: {e}") from None
    return out

"""raykv: a cluster-wide KV cache for LLM serving on Ray."""

from raykv.cluster import RaykvServices, attach, start
from raykv.config import ConfigError, RaykvConfig
from raykv.contract import (
    JobResult,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTier,
    TransferJob,
)
from raykv.errors import BlockError, RaykvError
from raykv.factory import TierFactory
from raykv.keys import OffloadKey, make_offload_key, prefix_keys

__version__ = "0.1.0"

__all__ = [
    "BlockError",
    "ConfigError",
    "JobResult",
    "LookupResult",
    "OffloadKey",
    "OffloadPolicy",
    "RaykvConfig",
    "RaykvError",
    "RaykvServices",
    "ReqContext",
    "RequestOffloadingContext",
    "SecondaryTier",
    "TierFactory",
    "TransferJob",
    "attach",
    "make_offload_key",
    "prefix_keys",
    "start",
]

"""raykv: a cluster-wide KV cache for LLM serving on Ray."""

from raykv.config.options import RaykvConfig
from raykv.core.contract import (
    JobResult,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTier,
    TransferJob,
)
from raykv.core.errors import BlockError, RaykvError
from raykv.core.factory import TierFactory
from raykv.core.keys import OffloadKey, make_offload_key, prefix_keys
from raykv.core.logs import configure_from_env
from raykv.core.validate import ConfigError
from raykv.services.cluster import RaykvServices, attach, start, stop

__version__ = "0.1.0"

configure_from_env()

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
    "stop",
]

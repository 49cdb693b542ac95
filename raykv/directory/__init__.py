"""The cluster-wide directory: which tier on which node holds each block."""

from raykv.core.placement import HolderInfo, PrefixHit
from raykv.directory.client import DirectoryClient, LookupCache

__all__ = ["DirectoryClient", "HolderInfo", "LookupCache", "PrefixHit"]

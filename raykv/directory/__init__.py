"""The cluster-wide directory: which tier on which node holds each block."""

from raykv.directory.client import DirectoryClient, LookupCache
from raykv.placement import HolderInfo, PrefixHit

__all__ = ["DirectoryClient", "HolderInfo", "LookupCache", "PrefixHit"]

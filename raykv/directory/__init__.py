"""The cluster-wide directory: which tier on which node holds each block."""

from raykv.directory.holders import HolderInfo
from raykv.directory.client import DirectoryClient, LookupCache, PolicyCache, PrefixHit

__all__ = ["DirectoryClient", "HolderInfo", "LookupCache", "PolicyCache", "PrefixHit"]

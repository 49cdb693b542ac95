"""Shared-storage tier: checksummed block files under a root on a shared
filesystem (NFS/Lustre/EFS mount) or any ``pyarrow.fs`` URI, with one
``FsRootActor`` per root for the index, LRU capacity and directory entries."""

from tiers.fs.actor import FsRootActor
from tiers.fs.tier import FsOptions, FsTier

__all__ = ["FsOptions", "FsRootActor", "FsTier"]

"""The plugin module named by this distribution's ``kvconnector.cache_policies`` entry point."""

from __future__ import annotations

from typing import Any

from kvconnector_core.plugins.hookspecs import hookimpl

__all__ = ["kvconnector_register_cache_policies"]


@hookimpl
def kvconnector_register_cache_policies(registry: Any) -> None:
    """Register S3FIFOCachePolicy as ``s3fifo``."""
    from s3fifo_policy.policy import S3FIFOCachePolicy  # imported only when plugins load

    registry.add("s3fifo", S3FIFOCachePolicy)

"""S3-FIFO for kvconnector's CPU offload tier, an example cache-policy plugin.

Primitives: :class:`S3FIFOCachePolicy` (:mod:`.policy`); the plugin hook is in :mod:`.plugin`.
"""

from __future__ import annotations

from s3fifo_policy.policy import S3FIFOCachePolicy

__all__ = ["S3FIFOCachePolicy"]

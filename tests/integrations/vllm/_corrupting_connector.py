"""A synchronous connector that corrupts one value of every block it loads (for the rig's
checks: ``vllm-check`` must exit 1 and name the first bad block)."""

from __future__ import annotations

from typing import ClassVar

from _plain_sync_connector import PlainSyncConnector


class CorruptingConnector(PlainSyncConnector):
    """:class:`PlainSyncConnector`, with the first value of each loaded block changed."""

    name: ClassVar[str] = "CorruptingConnector"

    def start_load_kv(self, forward_context=None):
        super().start_load_kv(forward_context)
        for _block_hash, block_id in self.get_connector_metadata().loads:
            self.kv[0][block_id].view(-1)[0] += 1

"""What a rig run observed: running counts (:class:`Stats`) and the final :class:`RigReport`.

Primitives: :class:`Stats`, :class:`RigReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvconnector_core.engine.report import _fmt_bytes

__all__ = ["RigReport", "Stats"]


@dataclass
class Stats:
    """Counts a rig keeps while it steps (read them any time as ``rig.stats``).

    Attributes:
        steps: steps scheduled.
        empty_steps: steps that scheduled no token.
        finished: requests finished (any reason).
        preemptions: preemptions.
        async_loads: requests seen waiting for their KV (``WAITING_FOR_REMOTE_KVS``):
            asynchronous loads, and every load of a kvconnector connector behind the
            adapter (it presents synchronous loads as receives).
        hit_tokens: tokens the connector said it would load.
        layer_blocks_checked: layer-blocks byte-checked (on every worker, every check).
        loaded_layer_blocks_checked: of those, blocks a connector load wrote (first check).
        hit_layer_blocks_checked: of those, blocks vLLM served from its prefix cache.
        bytes_loaded: bytes of the loaded layer-blocks checked.
        wrong_bytes: wrong bytes found, by kind of block (``loaded``, ``prefix hit``,
            ``computed``); only counted when the oracle does not raise.
        outputs: request id -> tokens generated.
        scheduled_tokens: request id -> tokens scheduled (computed) for it, in total.
    """

    steps: int = 0
    empty_steps: int = 0
    finished: int = 0
    preemptions: int = 0
    async_loads: int = 0
    hit_tokens: int = 0
    local_hit_tokens: int = 0
    layer_blocks_checked: int = 0
    loaded_layer_blocks_checked: int = 0
    hit_layer_blocks_checked: int = 0
    bytes_loaded: int = 0
    wrong_bytes: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    scheduled_tokens: dict[str, int] = field(default_factory=dict)


class RigReport(msgspec.Struct, kw_only=True):
    """The outcome of one rig run: what it did and every damage count (all 0 when it passed).

    Attributes:
        connector: the vLLM connector (and the kvconnector connector behind the adapter).
        layout: the KV cache layout.
        workers: worker connectors (TP ranks).
        requests: requests added.
        finished: requests that finished.
        hit_tokens: tokens the connector loaded (or said it would).
        bytes_loaded: bytes of loaded layer-blocks byte-checked.
        layer_blocks_checked: layer-blocks byte-checked in total.
        loaded_layer_blocks_checked: of those, written by a connector load.
        hit_layer_blocks_checked: of those, served from vLLM's prefix cache.
        wrong_bytes_loaded: wrong bytes in blocks a load wrote.
        wrong_bytes_hit: wrong bytes in blocks vLLM served as prefix-cache hits.
        wrong_bytes_other: wrong bytes in blocks the request computed itself.
        first_bad_block: the first wrong layer-block, named (None when all matched).
        unfinished: requests still unfinished when the step budget ran out.
        held_requests: requests vLLM still held once idle.
        leaked_blocks: GPU blocks still held after idle and shutdown.
        exceptions: exceptions that escaped into vLLM (type and message).
        steps: steps run.
        preemptions: preemptions.
        async_loads: requests that waited for their KV (see :class:`Stats`).
    """

    connector: str
    layout: str
    workers: int = 1
    requests: int = 0
    finished: int = 0
    hit_tokens: int = 0
    bytes_loaded: int = 0
    layer_blocks_checked: int = 0
    loaded_layer_blocks_checked: int = 0
    hit_layer_blocks_checked: int = 0
    wrong_bytes_loaded: int = 0
    wrong_bytes_hit: int = 0
    wrong_bytes_other: int = 0
    first_bad_block: str | None = None
    unfinished: int = 0
    held_requests: int = 0
    leaked_blocks: int = 0
    exceptions: list[str] = msgspec.field(default_factory=list)
    steps: int = 0
    preemptions: int = 0
    async_loads: int = 0

    @property
    def wrong_bytes(self) -> int:
        """Wrong bytes of every kind."""
        return self.wrong_bytes_loaded + self.wrong_bytes_hit + self.wrong_bytes_other

    @property
    def ok(self) -> bool:
        """No wrong byte, no leak, no held or unfinished request, no escaped exception."""
        return not (self.wrong_bytes or self.leaked_blocks or self.held_requests
                    or self.unfinished or self.exceptions)

    def to_dict(self) -> dict[str, object]:
        """The report as plain data, with ``ok``."""
        data: dict[str, object] = msgspec.to_builtins(self)
        data["ok"] = self.ok
        return data

    def format(self) -> str:
        """The human-readable report, in the shape of ``kvconnector run``'s."""
        title = f"vllm-check: {self.connector}, layout {self.layout}, {self.workers} worker(s)"
        wrong = (f"{self.wrong_bytes} (loaded {self.wrong_bytes_loaded}, prefix-cache hits "
                 f"{self.wrong_bytes_hit}, computed {self.wrong_bytes_other})")
        checked = (f"{self.layer_blocks_checked} ({self.loaded_layer_blocks_checked} loaded, "
                   f"{self.hit_layer_blocks_checked} prefix-cache hits)")
        rows = [
            ("requests", f"{self.finished} finished / {self.requests}"),
            ("served by connector", f"{self.hit_tokens} tokens"),
            ("loaded (connector -> GPU)", _fmt_bytes(self.bytes_loaded)),
            ("layer-blocks checked", checked),
            ("wrong bytes", wrong),
            ("first bad block", self.first_bad_block or "-"),
            ("leaked blocks", f"{self.leaked_blocks}"),
            ("requests held when idle", f"{self.held_requests}"),
            ("unfinished (step budget)", f"{self.unfinished}"),
            ("exceptions escaping", "; ".join(self.exceptions) or "0"),
            ("preemptions", f"{self.preemptions}"),
            ("async loads", f"{self.async_loads}"),
            ("steps", f"{self.steps}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append(f"result: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)

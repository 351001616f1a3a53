"""What bench_transfer.py and bench_interference.py share: variants, KV shapes, caches.

A variant is a label: a :class:`KVBlockMover` method name, optionally followed by
``, inline issue`` (copies issued on the caller's thread instead of the issue thread),
``, Tensor.copy_`` (every CUDA runtime shortcut off and inline issue: the fallback path,
which is how ``auto`` issued copies before the runtime calls existed), ``, per-plane
kernels`` (staged copies gather each plane with its own kernel, as before one span view
covered all planes) or ``, one lane`` (batched jobs on the direction's stream alone, as
before they were split over several streams), ``, per-job buffers`` (staged copies
allocate their index and staging memory and their events per job, as before
:class:`~connectors.offload.transfer.staging.StagingBuffers`), ``, 16 MiB stages`` (staged copies
in stages of 16 MiB, up to 16, as before), ``, no head`` (a batched job's first blocks
are not queued ahead of the rest), ``, int64 words`` (staged kernels move 8-byte words, not
16-byte ones), ``, even stages`` (no short first and last stage), ``, torch upload`` (the
gather index uploaded with ``Tensor.copy_`` and its buffer's event recorded at once),
``, index first`` (a store's first stage waits for the whole span index), ``, load index
on kernel stream`` (a load's index uploaded on the kernel stream, behind every DMA),
``, third-stage staging`` (those five together: the staged copies as the third stage left
them), ``, dma-only small jobs`` (``auto`` moves per-layer jobs of up to 128 MiB as per-row
DMAs), ``, dma-only small stores`` (the same for stores only) or ``, wake on claimed`` (the issue thread, woken for a job that a waiting caller
already issued, still sleeps and takes the GIL before it notices).

:func:`baseline_mover_class` loads the mover of another checkout (main) beside this one's,
so that a benchmark measures both in one process, interleaved.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from connectors.offload.transfer import cudart as _cudart
from connectors.offload.transfer import staging as _staged
from connectors.offload.transfer.mover import METHODS, KVBlockMover
from connectors.offload.transfer.staging import StagingBuffers

__all__ = ["DEFAULT_VARIANTS", "LAYOUTS", "FirstCopyClock", "add_kv_args", "apply_variant",
           "baseline_mover_class", "make_kv_caches", "restore"]

LAYOUTS = ["cross-layer", "per-layer", "per-layer, one allocation"]

OPTIONS = ("", "inline issue", "Tensor.copy_", "per-plane kernels", "one lane", "per-job buffers",
           "16 MiB stages", "no head", "int64 words", "even stages", "torch upload",
           "index first", "load index on kernel stream", "third-stage staging",
           "dma-only small jobs", "dma-only small stores", "wake on claimed")
_STAGING_OPTIONS = ("int64 words", "even stages", "torch upload", "index first",
                    "load index on kernel stream", "third-stage staging")
_STAGES = (_staged._STAGE_BYTES, _staged._MAX_GROUPS)  # this checkout's, for "16 MiB stages"

DEFAULT_VARIANTS = ["per_block", "coalesced", "gather", "batched", "pitched", "auto",
                    "auto, inline issue", "auto, Tensor.copy_"]


def apply_variant(mover: KVBlockMover, label: str) -> None:
    """Configure ``mover`` for the variant ``label`` (reversible: originals are kept)."""
    method, _, option = (part.strip() for part in label.partition(","))
    if method not in METHODS or option not in OPTIONS:
        msg = (f"unknown transfer variant {label!r}; methods: {', '.join(METHODS)}; "
               f"options: {', '.join(o for o in OPTIONS if o)}")
        raise ValueError(msg)
    # The same harness also drives older movers (main's, for a baseline in the same run):
    # they keep the copy knobs on themselves, with a leading underscore, and may lack the
    # staged plan and the lanes; their options are then no-ops.
    knobs, prefix = (mover.copier, "") if hasattr(mover, "copier") else (mover, "_")

    def get(name: str) -> Any:
        return getattr(knobs, prefix + name, None)

    def put(name: str, value: Any) -> None:
        setattr(knobs, prefix + name, value)

    names = ("memcpy", "batch_memcpy", "memcpy_2d", "gather_plan", "lanes", "staging",
             "head_blocks")
    saved = mover.__dict__.setdefault("_bench_saved", (
        *(get(n) for n in names[:3]), mover._issuer, *(get(n) for n in names[3:])))
    memcpy, batch, memcpy_2d, issuer, gather_plan, lanes, staging, head = saved
    mover.method = method
    fallback = option == "Tensor.copy_"
    for name, value in zip(names[:3], (None, None, None) if fallback else saved[:3],
                           strict=True):
        put(name, value)
    mover._issuer = None if option in ("inline issue", "Tensor.copy_") else issuer
    if gather_plan is not None:
        put("gather_plan", dataclasses.replace(gather_plan, source=None)
            if option == "per-plane kernels" else gather_plan)
    if lanes is not None:
        put("lanes", {True: [], False: []} if option == "one lane" else lanes)
    if staging is not None:
        put("staging", None if option == "per-job buffers" else staging)
    if option in _STAGING_OPTIONS and gather_plan is not None and hasattr(gather_plan, "taper"):
        plan, buffers = _staging_variant(mover, option, gather_plan)
        put("gather_plan", plan)
        put("staging", buffers)
    if head is not None:
        put("head_blocks", 0 if option == "no head" else head)
    if hasattr(type(mover), "_skip_claimed"):
        mover._skip_claimed = option != "wake on claimed"
    if get("dma_only_bytes") is not None:
        small = option in ("dma-only small jobs", "dma-only small stores")
        put("dma_only_bytes", (128 << 20) if small else 0)
        put("dma_only_loads", option != "dma-only small stores")
    # Module-wide (this checkout's staged copies): the stage size before this branch.
    _staged._STAGE_BYTES, _staged._MAX_GROUPS = (16 << 20, 16) if option == "16 MiB stages" else _STAGES


def _staging_variant(mover: KVBlockMover, option: str, plan: _staged.GatherPlan
                     ) -> tuple[_staged.GatherPlan, dict[bool, StagingBuffers]]:
    """The gather plan and staging buffers of one of :data:`_STAGING_OPTIONS` (made once)."""
    made = mover.__dict__.setdefault("_bench_staging", {})
    if option not in made:
        off = ({"int64 words", "even stages", "torch upload", "index first",
                "load index on kernel stream"} if option == "third-stage staging" else {option})
        if "int64 words" in off:
            plan = _staged.plan_gather(mover.layout.planes, mover.cpu_planes,
                                       _cudart.max_pitch(mover._device_index) if mover.copier.stage_2d else 0,
                                       word_bytes=8, taper=plan.taper)
        if "even stages" in off:
            plan = dataclasses.replace(plan, taper=False)
        memcpy = None if "torch upload" in off else mover.copier.memcpy
        made[option] = plan, {d: StagingBuffers(
            mover.device, plan, memcpy, ids_first="index first" not in off,
            load_index_on_dma_stream="load index on kernel stream" not in off) for d in (True, False)}
    return made[option]


def restore(mover: KVBlockMover) -> None:
    """Undo :func:`apply_variant` so that ``shutdown`` stops the issue thread."""
    apply_variant(mover, "auto")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """The device and KV cache shape options (Llama-3-8B by default: 2 MiB per block)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, help=f"any of {LAYOUTS}")


def make_kv_caches(args: argparse.Namespace, device: torch.device, layout: str
                   ) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors of ``args.num_gpu_blocks`` blocks in one of :data:`LAYOUTS`.

    ``cross-layer``: views of one ``(blocks, layers, ...)`` tensor (the engine's layout);
    ``per-layer``: one allocation per layer (vLLM's); ``per-layer, one allocation``: views of
    one ``(layers, blocks, ...)`` tensor, equally spaced, so 2D copies apply. Filled with
    random values: never time zeros.
    """
    shape = (args.num_gpu_blocks, 2, args.block_size, args.kv_heads, args.head_size)
    gen = torch.Generator(device=device).manual_seed(0)
    if layout == "cross-layer":
        base = torch.empty((shape[0], args.layers, *shape[1:]), dtype=torch.bfloat16, device=device)
        base.normal_(generator=gen)
        return {f"layer.{i}": base[:, i] for i in range(args.layers)}
    if layout == "per-layer, one allocation":
        whole = torch.empty((args.layers, *shape), dtype=torch.bfloat16, device=device)
        whole.normal_(generator=gen)
        return {f"layer.{i}": whole[i] for i in range(args.layers)}
    if layout == "per-layer":
        return {f"layer.{i}": torch.empty(shape, dtype=torch.bfloat16, device=device)
                .normal_(generator=gen) for i in range(args.layers)}
    msg = f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}"
    raise ValueError(msg)


def baseline_mover_class(root: str) -> type:
    """``KVBlockMover`` of the checkout at ``root`` (e.g. main), importable beside this one's.

    Its ``connectors/offload`` modules are copied into a private package (``baseline_offload``,
    imports rewritten), so neither checkout's modules shadow the other's.
    """
    src = pathlib.Path(root) / "connectors" / "offload"
    pkg = pathlib.Path(tempfile.mkdtemp(prefix="kvc-baseline-")) / "baseline_offload"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if (src / "transfer").is_dir():  # the transfer engine as a subpackage
        (pkg / "transfer").mkdir()
        paths = [(path, pkg / "transfer" / path.name) for path in (src / "transfer").glob("*.py")]
    else:  # the flat layout before it
        paths = [(path, pkg / path.name) for path in [*src.glob("_*.py"), src / "transfer.py"]
                 if path.name != "__init__.py"]
    for path, dest in paths:
        dest.write_text(path.read_text().replace("connectors.offload", "baseline_offload"))
    sys.path.insert(0, str(pkg.parent))
    import importlib
    return importlib.import_module("baseline_offload.transfer").KVBlockMover  # type: ignore[no-any-return]


class FirstCopyClock:
    """Records when a mover's runtime copy functions are called (host clock).

    Wraps the mover's ``cudaMemcpy*`` callables; :meth:`first_after` gives the time from a
    submission to the first copy call queued after it: the host latency before the first
    DMA, which a transfer of a few milliseconds pays in full.
    """

    _NAMES = ("memcpy", "batch_memcpy", "memcpy_2d", "stage_2d")

    def __init__(self, mover: KVBlockMover) -> None:
        self.calls: list[float] = []
        copier = mover.copier  # the copy method holds the runtime calls
        self._mover, self._saved = copier, {n: getattr(copier, n, None) for n in self._NAMES}
        for name, fn in self._saved.items():
            if fn is not None:
                setattr(copier, name, self._wrap(fn))

    def _wrap(self, fn: Callable[..., int]) -> Callable[..., int]:
        calls = self.calls

        def timed(*args: int) -> int:
            calls.append(time.perf_counter())
            return fn(*args)
        return timed

    def first_after(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the first copy call after it (None: none)."""
        later = [t for t in self.calls if t >= t0]
        return min(later) - t0 if later else None

    def close(self) -> None:
        """Put the original callables back."""
        for name, fn in self._saved.items():
            setattr(self._mover, name, fn)

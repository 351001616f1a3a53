"""One seeded engine run under fault injection, checked against a no-connector baseline.

A *cell* is a (connector, fault) pair; a seed fixes the workload, the engine's sizes and
every fault drawn, so ``run_cell(connector, fault, seed)`` is reproducible.

Connectors (:data:`CONNECTORS`): ``cpu_offload``; ``multi`` (MultiConnector of the TTL
example + cpu_offload); ``memory`` (the in-memory reference connector of the test suite,
``tests/_memory_connector.py``, with random sync/async loads, late saves and loads that
write garbage and raise).

Faults (:data:`FAULTS`): every hook of both roles raises at 1% (``raise_1pct``) or 10%
(``raise_10pct``) of its calls; one hook raises at 10% (``hook_10pct``: the hook cycles
with the seed, so each hook gets the same share of runs); one random hook raises once at a
random step (``raise_once``); ``transfer_only`` raises nothing. All five run alongside the
same transfer faults: 20% of loads fail, 10% of steps' stores fail, completions come up to
two steps late. In ``multi`` the children's hooks raise (MultiConnector contains them;
``raise_once`` picks one child) and the transfer faults wrap the MultiConnector.

Checks per run (:class:`RunOutcome`, each expected 0): outputs that differ from the
baseline; a deadlock (no finish within a step budget); an exception out of ``Engine.step``
(an uncontained raise); after every step, the event replica vs the real GPU prefix cache
and CPU tier; at the end, GPU blocks whose ref count the TTL pins do not explain, CPU
slots still pinned or being written, connector state naming a finished request, and
lookups that claimed a failed store.

Primitives: :data:`CONNECTORS`, :data:`FAULTS`, :class:`RunOutcome`, :func:`make_trace`,
:func:`run_cell`.
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path
from typing import Any

import msgspec

from _sweep_checks import (
    EventReplica,
    failed_store_hits,
    held_cpu_slots,
    leaked_gpu_refs,
    leftover_request_state,
    real_media,
)
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.testing.fault_settings import FAULT_HOOKS, FaultSettings, HookFault
from kvconnector_core.testing.faults import fault_injection_config
from kvconnector_core.worker.model import ModelConfig

__all__ = ["CHECKS", "CONNECTORS", "FAULTS", "RunOutcome", "make_trace", "run_cell"]

# The in-memory reference connector lives with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CONNECTORS = ("cpu_offload", "multi", "memory")
FAULTS = ("transfer_only", "raise_1pct", "raise_10pct", "hook_10pct", "raise_once")
CHECKS = ("wrong_output", "deadlock", "crash", "replica", "gpu_refs", "cpu_slots", "req_state",
          "failed_store_visible")
"""The per-run checks, in table order."""

_HOOKS = tuple(sorted(FAULT_HOOKS))
_MODEL = ModelConfig(vocab_size=512, layer_types=("full", "full"), num_kv_heads=1, head_size=8, mlp_size=16)
_BLOCK = 4
_MAX_LEN = 64
_ONCE_MAX_STEP = 40  # workloads take ~30-80 steps


class RunOutcome(msgspec.Struct):
    """What one run found; each count is expected to be 0.

    Attributes:
        connector, fault, seed: the cell and seed.
        counts: check name -> what it counted (requests, steps, blocks, slots, ...).
        detail: first message per failing check.
        steps: engine steps the run took.
        hooks: for single-hook faults, the raising hook as ``Connector.hook`` (``@step``
            for a raise once).
        started: False when the engine refused to start (a hook raised while it was being
            built: ``bind_gpu_block_pool``, ``register_kv_caches``); such a run did no work and
            fails no check.
    """

    connector: str
    fault: str
    seed: int
    counts: dict[str, int]
    detail: dict[str, str]
    steps: int = 0
    started: bool = True
    hooks: list[str] = msgspec.field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        """Names of the checks this run failed."""
        return [c for c in CHECKS if self.counts.get(c)]


def make_trace(seed: int) -> list[TraceRequest]:
    """8-12 short requests over 3-5 prefixes, arriving a few steps apart, some prompts repeated.

    The GPU pool holds about two prefixes, so a prefix that comes back has usually left
    the GPU and is served by the connector (when it kept it).
    """
    rng = random.Random(seed)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(12, 25))] for _ in range(rng.randrange(4, 8))]
    trace: list[TraceRequest] = []
    arrival = 0
    for i in range(rng.randrange(8, 13)):
        prompt = rng.choice(prefixes) + [rng.randrange(512) for _ in range(rng.randrange(4, 17))]
        if trace and rng.random() < 0.2:
            prompt = list(rng.choice(trace).prompt_token_ids)  # an identical prompt (full hit)
        trace.append(TraceRequest(arrival=arrival, prompt_token_ids=prompt,
                                  max_new_tokens=rng.randrange(2, 7), request_id=f"r{i}"))
        arrival += rng.randrange(0, 9)
    return trace


def _engine_config(seed: int, connector: KVConnectorConfig | None) -> EngineConfig:
    rng = random.Random(f"{seed}:engine")
    return EngineConfig(model=_MODEL, num_gpu_blocks=rng.randrange(18, 23), block_size=_BLOCK,
                        max_num_batched_tokens=rng.choice((16, 32, 64)), max_num_seqs=rng.choice((2, 4)),
                        max_model_len=_MAX_LEN, connector=connector,
                        enable_kv_cache_events=True)  # the end checks replay the events


def _settings(fault: str, seed: int, rng: random.Random, *, raises: bool, transfers: bool) -> FaultSettings:
    raise_in: tuple[HookFault, ...] = ()
    if raises and fault in ("raise_1pct", "raise_10pct"):
        rate = 0.01 if fault == "raise_1pct" else 0.1
        raise_in = tuple(HookFault(hook=h, rate=rate) for h in _HOOKS)
    elif raises and fault == "hook_10pct":
        raise_in = (HookFault(hook=fault_hook(seed), rate=0.1),)
    return FaultSettings(load_failure_rate=0.2 if transfers else 0.0,
                         store_failure_rate=0.1 if transfers else 0.0,
                         completion_delay_steps=2 if transfers else 0,
                         raise_in=raise_in, seed=rng.randrange(2**31))


def fault_hook(seed: int) -> str:
    """The hook that raises in a ``hook_10pct`` run of this seed."""
    return _HOOKS[seed % len(_HOOKS)]


def _once(settings: FaultSettings, rng: random.Random) -> FaultSettings:
    once = HookFault(hook=rng.choice(_HOOKS), at_step=rng.randrange(_ONCE_MAX_STEP))
    return msgspec.structs.replace(settings, raise_in=(once,))


def connector_config(connector: str, fault: str, seed: int) -> KVConnectorConfig:
    """The fault-wrapped connector config of a cell and seed."""
    rng = random.Random(f"{seed}:{connector}:{fault}")
    offload = {"name": "cpu_offload", "extra_config": {
        "num_cpu_blocks": rng.randrange(24, 73), "blocks_per_chunk": 1, "cache_policy": rng.choice(("lru", "arc"))}}
    if connector == "multi":
        children = [{"name": "ttl", "extra_config": {"ttl_seconds": 1000, "max_pinned_blocks": 4}}, offload]
        child_settings = [_settings(fault, seed, rng, raises=True, transfers=False) for _ in children]
        if fault == "raise_once":
            k = rng.randrange(len(children))
            child_settings[k] = _once(child_settings[k], rng)
        wrapped = [fault_injection_config(c, s).to_dict() for c, s in zip(children, child_settings, strict=True)]
        multi = {"name": "MultiConnector", "extra_config": {"connectors": wrapped}}
        return fault_injection_config(multi, _settings(fault, seed, rng, raises=False, transfers=True))
    if connector == "memory":
        load_async = rng.random() < 0.5
        inner: dict[str, Any] = {"name": "InMemoryConnector", "module_path": "_memory_connector", "extra_config": {
            "load_async": load_async, "save_delay": rng.randrange(3), "fail_start_load": rng.randrange(3),
            # sync loads with the per-step flag only (the scheduler's has_sync_kv_loads) half the time
            "sync_flag": (not load_async) and rng.random() < 0.5}}
    elif connector == "cpu_offload":
        inner = offload
    else:
        msg = f"unknown sweep connector {connector!r}; valid: {', '.join(CONNECTORS)}"
        raise ValueError(msg)
    settings = _settings(fault, seed, rng, raises=True, transfers=True)
    if fault == "raise_once":
        settings = _once(settings, rng)
    return fault_injection_config(inner, settings)


class _Driver:
    """Steps an engine through a trace like ``Engine.run``, checking after every step."""

    def __init__(self, engine: Engine, trace: list[TraceRequest], budget: int, replica: bool) -> None:
        self.engine, self.trace, self.budget = engine, trace, budget
        self.outputs: dict[str, list[int]] = {}
        self.replica = EventReplica() if replica else None
        self.replica_bad_steps = 0
        self.replica_first: str | None = None
        self._events: list[Any] = []
        if replica:
            take = engine.scheduler.take_events

            def tee() -> list[Any]:
                events = list(take())
                self._events += events
                return events

            engine.scheduler.take_events = tee  # type: ignore[method-assign]

    def run(self) -> bool:
        """Run to completion; False when the step budget ran out (a deadlock)."""
        eng, pending = self.engine, list(self.trace)
        while pending or eng.has_unfinished_requests():
            if eng.num_steps >= self.budget:
                return False
            if not eng.has_unfinished_requests():
                eng.num_steps = max(eng.num_steps, int(pending[0].arrival))
            while pending and pending[0].arrival <= eng.num_steps:
                r = pending.pop(0)
                eng.add_request(r.prompt_token_ids, r.max_new_tokens, request_id=r.request_id)
            for out in eng.step():
                self.outputs[out.request_id] = out.output_token_ids
            self._check_replica()
        return True

    def _check_replica(self) -> None:
        if self.replica is None:
            return
        self.replica.apply(self._events)
        self._events = []
        gpu, cpu = real_media(self.engine)
        diff = self.replica.diff(gpu, cpu)
        if diff is not None:
            self.replica_bad_steps += 1
            self.replica_first = self.replica_first or f"step {self.engine.num_steps}: {diff}"


def baseline_outputs(seed: int) -> tuple[dict[str, list[int]], int]:
    """The no-connector outputs of a seed's workload, and its steps."""
    eng = Engine(_engine_config(seed, None))
    driver = _Driver(eng, make_trace(seed), budget=10_000, replica=False)
    if not driver.run():
        msg = f"seed {seed}: the baseline did not finish"
        raise RuntimeError(msg)
    return driver.outputs, eng.num_steps


def run_cell(connector: str, fault: str, seed: int,
             baseline: tuple[dict[str, list[int]], int] | None = None) -> RunOutcome:
    """Run one cell and seed; ``baseline`` (from :func:`baseline_outputs`) saves a run."""
    logging.disable(logging.CRITICAL)  # contained errors are logged by design; counted here
    expected, base_steps = baseline or baseline_outputs(seed)
    trace = make_trace(seed)
    counts = dict.fromkeys(CHECKS, 0)
    detail: dict[str, str] = {}
    config = connector_config(connector, fault, seed)
    hooks = _single_hooks(config) if fault in ("hook_10pct", "raise_once") else []
    try:
        eng = Engine(_engine_config(seed, config))
    except Exception as exc:  # noqa: BLE001 - refusing to start with a broken connector is no damage
        detail["startup_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return RunOutcome(connector, fault, seed, counts, detail, started=False, hooks=hooks)
    try:
        driver = _Driver(eng, trace, budget=4 * base_steps + 200, replica=True)
        finished = driver.run()
    except Exception as exc:  # noqa: BLE001 - an exception out of the engine is a finding
        counts["crash"] = 1
        detail["crash"] = f"{type(exc).__name__}: {exc}"[:300]
        return RunOutcome(connector, fault, seed, counts, detail, hooks=hooks)
    if not finished:
        counts["deadlock"] = 1
        detail["deadlock"] = f"unfinished after {eng.num_steps} steps: {sorted(eng.scheduler.requests)[:5]}"
    wrong = [rid for rid in expected if driver.outputs.get(rid) != expected[rid]]
    counts["wrong_output"] = len(wrong) if finished else 0
    if counts["wrong_output"]:
        rid = wrong[0]
        detail["wrong_output"] = f"{rid}: expected {expected[rid]}, got {driver.outputs.get(rid)}"
    counts["replica"] = driver.replica_bad_steps
    if driver.replica_first:
        detail["replica"] = driver.replica_first
    if finished:
        counts["gpu_refs"] = leaked_gpu_refs(eng)
        counts["cpu_slots"] = held_cpu_slots(eng)
        left = leftover_request_state(eng, {r.request_id for r in trace})
        counts["req_state"] = len(left)
        if left:
            detail["req_state"] = "; ".join(left[:3])
    counts["failed_store_visible"] = failed_store_hits(eng)
    for check in ("gpu_refs", "cpu_slots", "failed_store_visible"):
        if counts[check]:
            detail[check] = f"{counts[check]}"
    try:
        eng.shutdown()
    except Exception:  # noqa: BLE001,S110 - an injected shutdown fault; shutdown is not checked
        pass
    return RunOutcome(connector, fault, seed, counts, detail, steps=eng.num_steps, hooks=hooks)


def _single_hooks(config: KVConnectorConfig) -> list[str]:
    """``Inner.hook`` (``@step``) of every HookFault in a (possibly nested) fault config."""
    out = []
    extra = config.extra_config
    inner = extra.get("inner", {})
    for fault in extra.get("raise_in", ()):
        at = f"@{fault['at_step']}" if fault.get("at_step") is not None else ""
        out.append(f"{inner.get('name')}.{fault['hook']}{at}")
    for child in inner.get("extra_config", {}).get("connectors", ()):
        out += _single_hooks(KVConnectorConfig.from_dict(child))
    return out

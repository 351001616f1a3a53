"""Executes one :class:`SchedulerOutput` on the paged model and drives the worker-side
connector hooks.

Per step, with a connector (the reference order; the same order runs with no forward when
nothing is scheduled)::

    bind_connector_metadata(meta)
    handle_preemptions(meta)
    [start_load_kv()                     if the step has sync loads: before the forward]
    forward: per layer wait_for_layer_load(layer) ... write KV, attend ... save_kv_layer(...)
    [start_load_kv()                     otherwise: after the forward was launched]
    wait_for_save()
    get_transfer_results(scheduler_output.finished_req_ids)   (default: wraps get_finished)
    get_block_ids_with_load_errors()
    get_kv_connector_stats()
    [get_kv_connector_kv_cache_events()  if the connector defines it]
    build_connector_worker_meta()
    clear_connector_metadata()

"The step has sync loads" is ``scheduler_output.has_sync_kv_loads`` (the scheduler sets
it when a request admitted this step loads with ``load_async=False``) or the connector's
class attribute ``has_sync_kv_loads`` (a static override: always load before the forward).

The connector is called only through a
:class:`~kvconnector_core.connector.guard.GuardedWorker`, which contains what a hook raises
(logged, counted in :attr:`ModelRunner.connector_errors`) and records what failed; the
runner turns that into the step's report (``docs/failure-contract.md`` has the table):

- the step's loads failed (``loads_failed``) in a step with sync loads: the blocks those
  loads may have been writing are reported as invalid (see
  :meth:`ModelRunner._blocks_of_loaded_prefixes` for which), so the scheduler rolls the
  owners back and recomputes; the cost is recomputation, never wrong output. The flag
  travels in the :class:`KVConnectorOutput`; the scheduler also fails the async loads
  it planned this step (the worker cannot name them).
- which loads failed is unknown (``get_block_ids_with_load_errors`` raised): every
  receive reported finished this step is reported failed too.
- the step's stores failed (``stores_failed``): the flag travels to the scheduler side.

The runner keeps, per request, its token ids (prompt + the tokens it sampled) and block
ids per KV cache group; see :mod:`kvconnector_core.scheduler.output` for how the
scheduler updates them. It samples a token for a request when the step's chunk reaches the
end of the request's known tokens.

Primitives: :class:`ModelRunner`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvconnector_core.connector.guard import GuardedWorker
from kvconnector_core.connector.metadata import KVConnectorOutput
from kvconnector_core.errors import ConfigError, InvariantError
from kvconnector_core.kv_cache.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec
from kvconnector_core.scheduler.output import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from kvconnector_core.worker._batch import _GroupBuilder, _RequestState
from kvconnector_core.worker.kv_cache import KVCacheTensors, allocate_kv_caches
from kvconnector_core.worker.model import (
    ForwardBatch,
    GroupAttentionMetadata,
    ModelConfig,
    PagedIntModel,
)

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = ["ModelRunner"]

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the paged KV tensors and the model; runs scheduler outputs.

    Args:
        model_config: the model.
        kv_cache_config: pool size and KV cache groups (must hold every model layer).
        device: ``"cpu"`` or ``"cuda"``.
        connector: the worker-side connector instance, or None. It receives
            ``register_kv_caches`` here.
    """

    def __init__(self, model_config: ModelConfig, kv_cache_config: KVCacheConfig,
                 device: str | torch.device = "cpu",
                 connector: KVConnectorBase_V1 | None = None) -> None:
        self.device = torch.device(device)
        self.kv_cache_config = kv_cache_config
        self.kv_caches: KVCacheTensors = allocate_kv_caches(kv_cache_config, self.device)
        self.model = PagedIntModel(model_config, self.kv_caches.layer_to_group, self.device)
        #: Per worker hook name, how many times the connector raised (contained).
        self.connector_errors: dict[str, int] = {}
        #: The worker-side connector behind its guard, or None.
        self.connector: GuardedWorker | None = (
            GuardedWorker(connector, errors=self.connector_errors) if connector is not None
            else None)
        self._windows = [
            g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 0
            for g in kv_cache_config.kv_cache_groups
        ]
        self._chunks = [
            g.kv_cache_spec.attention_chunk_size
            if isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec) else 0
            for g in kv_cache_config.kv_cache_groups
        ]
        self._check_windows(model_config)
        self.requests: dict[str, _RequestState] = {}
        self._sync_loads = False
        # Preempted requests keep their worker state (tokens) but their blocks were freed;
        # they hold no block until resumed with a new block table.
        self._preempted: set[str] = set()
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_caches.layer_tensors)

    def _check_windows(self, model_config: ModelConfig) -> None:
        for name, (kind, size) in zip(model_config.layer_names(), model_config.layer_attention()):
            g = self.kv_caches.layer_to_group[name][0]
            got = (self._windows[g], self._chunks[g])
            expected = (size if kind == "sliding" else 0, size if kind == "chunked" else 0)
            if got != expected:
                msg = (f"layer {name!r} is {kind!r} (window, chunk {expected}) but its KV cache "
                       f"group has window, chunk {got}; build the KVCacheConfig from "
                       "ModelConfig.kv_cache_specs()")
                raise ConfigError(msg)

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._preempted.discard(req_id)
        self._preempted |= so.preempted_req_ids
        self._preempted -= {n.req_id for n in so.scheduled_new_reqs}
        self._preempted -= so.scheduled_cached_reqs.resumed_req_ids
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            # A re-sent request keeps the tokens it sampled if they extend the prompt.
            prompt = new.prompt_token_ids
            keep = old is not None and old.token_ids[:len(prompt)] == prompt
            tokens = old.token_ids if keep and old is not None else list(prompt)
            self.requests[new.req_id] = _RequestState(
                new.req_id, tokens, len(prompt), [list(b) for b in new.block_ids])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                msg = f"cached request {req_id!r} was never sent as a new request to the worker"
                raise InvariantError(msg)
            self._update_cached(state, cached, i)

    @staticmethod
    def _update_cached(state: _RequestState, cached: CachedRequestData, i: int) -> None:
        """Apply entry ``i`` of a step's cached-request data to one request's state."""
        resumed = state.req_id in cached.resumed_req_ids
        if cached.new_token_ids and cached.new_token_ids[i]:
            if resumed:
                state.token_ids = list(cached.new_token_ids[i])
            else:
                state.token_ids.extend(cached.new_token_ids[i])
        if cached.num_output_tokens:
            # The scheduler discards a step's sample when that step's sync load failed.
            del state.token_ids[state.num_prompt_tokens + cached.num_output_tokens[i]:]
        new_blocks = cached.new_block_ids[i]
        if new_blocks is None:
            return
        if resumed:
            state.block_ids = [list(b) for b in new_blocks]
            return
        for group_ids, added in zip(state.block_ids, new_blocks):
            group_ids.extend(added)

    def _scheduled(self, so: SchedulerOutput) -> list[tuple[_RequestState, int, int]]:
        """``(state, num_computed_tokens, num_scheduled)`` of every request with work."""
        out = []
        entries = [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        entries += zip(cached.req_ids, cached.num_computed_tokens)
        for req_id, num_computed in entries:
            num_scheduled = so.num_scheduled_tokens.get(req_id, 0)
            if num_scheduled <= 0:
                continue
            state = self.requests[req_id]
            if num_computed + num_scheduled > len(state.token_ids):
                msg = (f"request {req_id!r}: scheduled tokens [{num_computed}, "
                       f"{num_computed + num_scheduled}) but the worker knows only "
                       f"{len(state.token_ids)} tokens")
                raise InvariantError(msg)
            out.append((state, num_computed, num_scheduled))
        return out

    def _build_batch(self, work: list[tuple[_RequestState, int, int]]
                     ) -> tuple[ForwardBatch, list[str]]:
        builders = [_GroupBuilder(g, g_spec.kv_cache_spec.block_size, self._windows[g],
                                  self._chunks[g])
                    for g, g_spec in enumerate(self.kv_cache_config.kv_cache_groups)]
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        for state, start, num in work:
            row = len(token_ids)
            token_ids.extend(state.token_ids[start:start + num])
            positions.append(torch.arange(start, start + num, dtype=torch.int64))
            for builder in builders:
                builder.add(state, row, start, num)
            if start + num == len(state.token_ids):
                sample_rows.append(row + num - 1)
                sample_req_ids.append(state.req_id)
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64).to(self.device),
            positions=torch.cat(positions).to(self.device),
            groups=[b.build(self.device) for b in builders],
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64).to(self.device),
        )
        return batch, sample_req_ids

    # ------------------------------------------------------------------ step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update request state, run the connector hooks and the forward.

        Args:
            scheduler_output: the step's plan.

        Returns:
            The sampled tokens and, with a connector, its report.

        Raises:
            InvariantError: the plan is inconsistent with what the worker knows (unknown
                request, too few blocks, tokens the worker never saw, a visible key in the
                null block).
        """
        so = scheduler_output
        self._update_states(so)
        work = self._scheduled(so)
        connector = self.connector
        # The per-step flag is authoritative; the class attribute forces sync behaviour.
        sync = connector is not None and (so.has_sync_kv_loads or connector.has_sync_kv_loads)
        self._sync_loads = sync
        if connector is not None:
            connector.begin_step(sync_loads=sync)
            plan = so.kv_connector_metadata
            if plan is not None:  # None: the scheduler side built no plan (see the guard)
                connector.bind_connector_metadata(plan)
                connector.handle_preemptions(plan)
            if sync:
                connector.start_load_kv(None)
        sampled: dict[str, list[int]] = {}
        if work:
            sampled = self._forward(work)
        elif connector is not None and not sync:
            connector.start_load_kv(None)  # empty step: no forward, same hook order
        kv_output = self._finish_connector_step(so) if connector is not None else None
        return ModelRunnerOutput(
            req_ids=[state.req_id for state, _, _ in work],
            sampled_token_ids={state.req_id: sampled.get(state.req_id, []) for state, _, _ in work},
            kv_connector_output=kv_output,
        )

    def _forward(self, work: list[tuple[_RequestState, int, int]]) -> dict[str, list[int]]:
        batch, sample_req_ids = self._build_batch(work)
        connector = self.connector
        before = after = None
        if connector is not None and connector.uses_layer_hooks:
            before = connector.wait_for_layer_load

            def after(name: str, kv_layer: torch.Tensor, meta: GroupAttentionMetadata) -> None:
                connector.save_kv_layer(name, kv_layer, meta)
        hidden = self.model.forward(batch, self.kv_caches.layer_tensors,
                                    before_layer=before, after_layer=after)
        if connector is not None and not self._sync_loads:
            # Async loads target blocks of requests that are not in this batch, so they
            # may start once the forward is launched (on CPU: once it returned).
            connector.start_load_kv(None)
        tokens = self.model.sample(hidden[batch.sample_rows]).tolist()
        sampled: dict[str, list[int]] = {}
        for req_id, token in zip(sample_req_ids, tokens):
            self.requests[req_id].token_ids.append(token)
            sampled[req_id] = [token]
        return sampled

    def _finish_connector_step(self, so: SchedulerOutput) -> KVConnectorOutput:
        connector = self.connector
        assert connector is not None  # noqa: S101 - checked by the caller
        connector.wait_for_save()
        results = connector.get_transfer_results(set(so.finished_req_ids))
        invalid = connector.get_block_ids_with_load_errors()
        stats = connector.get_kv_connector_stats()
        events = connector.get_kv_connector_kv_cache_events()
        # Reference order: after the events, before clear; travels to the scheduler
        # side's update_connector_output as KVConnectorOutput.kv_connector_worker_meta.
        worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        # No plan (build_connector_meta raised): the step's sync loads never ran.
        if (connector.loads_failed or so.kv_connector_metadata is None) and self._sync_loads:
            # Without sync loads this step, no block the forward read was being loaded, so
            # failed loads invalidate nothing the batch used (async loads: the scheduler
            # fails the ones it planned this step).
            invalid |= self._blocks_of_loaded_prefixes(so)
        failed_recving = results.failed_recving
        if connector.load_errors_unknown:
            failed_recving = set(results.finished_recving)
        return KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=failed_recving,
            invalid_block_ids=invalid, kv_connector_stats=stats,
            kv_cache_events=events, kv_connector_worker_meta=worker_meta,
            loads_failed=connector.loads_failed, stores_failed=connector.stores_failed,
        )

    def _block_holders(self) -> dict[int, int]:
        """How many requests hold each block (the runner's state is already updated)."""
        holders: dict[int, int] = {}
        for state in self.requests.values():
            if state.req_id in self._preempted:
                continue  # its blocks were freed (and may be this step's load targets)
            for block_id in {b for group_ids in state.block_ids for b in group_ids}:
                holders[block_id] = holders.get(block_id, 0) + 1
        return holders

    def _blocks_of_loaded_prefixes(self, so: SchedulerOutput) -> set[int]:
        """Blocks a failed sync load may have been writing.

        A sync load targets requests admitted this step (new ones, and resumed ones, whose
        admission recomputes from zero), and only blocks below their
        ``num_computed_tokens``. That region mixes the local prefix-cache hit (valid) with
        the connector's targets, and the worker is not told the split. Load targets are
        freshly allocated and cached only after the load succeeded, so no other request
        can hold them; a block that also appears in another request's block table is
        therefore a shared prefix hit and is left out, so a failed load never evicts a
        shared prefix or rolls back unrelated requests. An unshared local hit is still
        reported (the scheduler recomputes it): costly, but never wrong output.
        """
        admitted: list[tuple[str, int, tuple[list[int], ...]]] = [
            (n.req_id, n.num_computed_tokens, n.block_ids) for n in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                admitted.append((req_id, cached.num_computed_tokens[i], new_ids))
        holders = self._block_holders()
        bad: set[int] = set()
        for _, num_computed, block_ids in admitted:
            if num_computed <= 0:
                continue
            for g, group_ids in enumerate(block_ids):
                bs = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size
                bad.update(b for b in group_ids[:-(-num_computed // bs)]
                           if b != 0 and holders.get(b, 0) <= 1)
        return bad

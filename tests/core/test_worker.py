"""Worker: paged KV tensors, cross-layer views, model runner state and connector hook order."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from _runner_harness import make_kv_cache_config, run_requests

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.errors import InvariantError
from kvconnector_core.scheduler.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from kvconnector_core.worker.kv_cache import (
    allocate_kv_caches,
    cross_layer_block_view,
    group_layers_by_storage,
)
from kvconnector_core.worker.model import ModelConfig
from kvconnector_core.worker.model_runner import ModelRunner

HYBRID = ModelConfig(layer_types=("full", "sliding", "full"), sliding_window=5)


def test_layout_is_block_major_cross_layer():
    """One block of all layers of a group is one contiguous chunk; layer views alias it."""
    cfg = make_kv_cache_config(HYBRID, block_size=4, num_blocks=100)
    kv = allocate_kv_caches(cfg)
    assert len(kv.group_tensors) == 2
    full = kv.group_tensors[0]
    assert full.shape == (cfg.num_blocks, 2, 2, 4, 2, 16) and full.is_contiguous()
    assert full.dtype == torch.int32
    assert list(kv.layer_tensors) == ["layers.0.attn", "layers.2.attn", "layers.1.attn"]
    kv.layer_tensors["layers.2.attn"][7, 1, 3] = 5
    assert int(full[7, 1, 1, 3].sum()) == 5 * 32


def test_cross_layer_block_view_shares_memory_per_group():
    """The uint8 view covers one block of every layer and writes through; mixed groups -> None."""
    cfg = make_kv_cache_config(HYBRID, block_size=4, num_blocks=100)
    kv = allocate_kv_caches(cfg)
    groups = group_layers_by_storage(kv.layer_tensors)
    assert [list(g) for g in groups] == [["layers.0.attn", "layers.2.attn"], ["layers.1.attn"]]
    view = cross_layer_block_view(groups[0])
    assert view.dtype == torch.uint8 and view.shape == (cfg.num_blocks, kv.bytes_per_block(0))
    view[3] = 1  # every byte of block 3, both layers, K and V
    expected = int.from_bytes(b"\x01\x01\x01\x01", "little")
    assert bool((kv.layer_tensors["layers.2.attn"][3] == expected).all())
    assert int(kv.layer_tensors["layers.0.attn"][2].abs().sum()) == 0
    assert cross_layer_block_view(kv.layer_tensors) is None  # two storages
    reversed_layers = dict(reversed(list(groups[0].items())))
    assert cross_layer_block_view(reversed_layers) is None  # wrong layer order
    assert cross_layer_block_view({"a": torch.zeros(4, 2, 3)}) is not None


def test_groups_of_equal_page_size_share_one_pool():
    """Layer i of every group of a pool is slot i of the same memory (vLLM's layout):
    a full + sliding model of 2 + 1 layers allocates 2 layers' pages per block, not 3."""
    cfg = make_kv_cache_config(HYBRID, block_size=4, num_blocks=100)
    kv = allocate_kv_caches(cfg)
    page = cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert len(kv.pool_tensors) == 1 and kv.pool_of_group == [0, 0]
    assert kv.nbytes == cfg.num_blocks * 2 * page == cfg.num_blocks * cfg.bytes_per_block
    sliding, full0 = kv.layer_tensors["layers.1.attn"], kv.layer_tensors["layers.0.attn"]
    assert sliding.data_ptr() == full0.data_ptr()  # slot 0 of the same pool
    sliding[9, 0, 1] = 3  # block 9 used by the sliding group
    assert int(full0[9, 0, 1].sum()) == 3 * 32 and int(full0[8].abs().sum()) == 0


def test_group_layers_by_storage_splits_groups_of_a_shared_pool():
    cfg = make_kv_cache_config(HYBRID, block_size=4, num_blocks=100)
    kv = allocate_kv_caches(cfg)
    groups = group_layers_by_storage(kv.layer_tensors)
    assert [list(g) for g in groups] == [["layers.0.attn", "layers.2.attn"], ["layers.1.attn"]]


class _Meta(KVConnectorMetadata, kw_only=True):
    step: int = 0


class _RecordingWorker(KVConnectorBase_V1):
    """Records worker hooks; the sync variant asks for start_load_kv before the forward."""

    name: ClassVar[str] = "recording-worker"
    metadata_type = _Meta

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.raise_in: set[str] = set()

    def _rec(self, hook: str) -> None:
        self.calls.append(hook)
        if hook in self.raise_in:
            raise RuntimeError(f"injected failure in {hook}")

    def register_kv_caches(self, kv_caches):
        self._rec("register_kv_caches")

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self._rec("bind_connector_metadata")

    def start_load_kv(self, forward_context=None):
        self._get_connector_metadata()
        self._rec("start_load_kv")

    def wait_for_layer_load(self, layer_name):
        self._rec(f"wait_for_layer_load:{layer_name}")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None):
        assert kv_layer.dim() == 5
        self._rec(f"save_kv_layer:{layer_name}")

    def wait_for_save(self):
        self._get_connector_metadata()  # metadata must still be bound
        self._rec("wait_for_save")

    def get_finished(self, finished_req_ids):
        self._rec("get_finished")
        return None, None

    def get_block_ids_with_load_errors(self):
        self._rec("get_block_ids_with_load_errors")
        return set()

    def get_kv_connector_stats(self):
        self._rec("get_kv_connector_stats")
        return {"bytes_loaded": 0}

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self._rec("clear_connector_metadata")

    # scheduler side: unused here
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return _Meta()


class _SyncRecordingWorker(_RecordingWorker):
    has_sync_kv_loads = True


def _layer_calls(names: list[str]) -> list[str]:
    out = []
    for n in names:
        out += [f"wait_for_layer_load:{n}", f"save_kv_layer:{n}"]
    return out


TAIL = ["wait_for_save", "get_finished", "get_block_ids_with_load_errors",
        "get_kv_connector_stats", "clear_connector_metadata"]
# In a step with synchronous loads the guard reads the load errors before the saves too.
SYNC_TAIL = ["get_block_ids_with_load_errors", *TAIL]


@pytest.mark.parametrize("cls", [_RecordingWorker, _SyncRecordingWorker], ids=["async", "sync"])
def test_worker_hook_order_matches_reference(cls):
    """bind -> [sync: start_load] -> layers -> [async: start_load] -> wait_for_save -> ... ->
    clear."""
    mc = ModelConfig(layer_types=("full", "full"))
    cfg = make_kv_cache_config(mc)
    conn = cls(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    runner = ModelRunner(mc, cfg, connector=conn)
    assert conn.calls == ["register_kv_caches"]
    layers = _layer_calls(mc.layer_names())
    expected_step = (
        ["bind_connector_metadata", "start_load_kv", *layers, *SYNC_TAIL]
        if cls.has_sync_kv_loads
        else ["bind_connector_metadata", *layers, "start_load_kv", *TAIL]
    )
    conn.calls.clear()
    so = SchedulerOutput(
        [NewRequestData("a", [1, 2, 3], ([1],), 0)],
        CachedRequestData.make_empty(),
        {"a": 3},
        3,
        set(),
        set(),
        _Meta(),
    )
    out = runner.execute_model(so)
    assert conn.calls == expected_step
    assert out.kv_connector_output is not None and out.sampled_token_ids["a"]
    # An empty step runs the same hooks, without layers.
    conn.calls.clear()
    empty = SchedulerOutput.make_empty()
    empty.kv_connector_metadata = _Meta()
    runner.execute_model(empty)
    tail = SYNC_TAIL if cls.has_sync_kv_loads else TAIL
    assert conn.calls == ["bind_connector_metadata", "start_load_kv", *tail]


def test_raising_worker_hooks_are_contained_and_failed_sync_load_reports_blocks():
    """A raising hook is counted, the step completes; a failed sync load marks loaded blocks
    invalid, and the step's saves (computed on those blocks) never reach the connector."""
    mc = ModelConfig(layer_types=("full",))
    cfg = make_kv_cache_config(mc, block_size=4)
    conn = _SyncRecordingWorker(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    conn.raise_in = {"start_load_kv", "wait_for_save"}
    runner = ModelRunner(mc, cfg, connector=conn)
    # 8 of 10 tokens "loaded" by the connector into blocks 5 and 6; block 7 is computed.
    so = SchedulerOutput(
        [NewRequestData("a", list(range(10)), ([5, 6, 7],), 8)],
        CachedRequestData.make_empty(),
        {"a": 2},
        2,
        set(),
        set(),
        _Meta(),
    )
    out = runner.execute_model(so)
    assert runner.connector_errors == {"start_load_kv": 1}
    assert "wait_for_save" not in conn.calls
    assert out.kv_connector_output.stores_failed
    assert out.kv_connector_output.invalid_block_ids == {5, 6}
    assert conn.calls[-1] == "clear_connector_metadata"


def test_a_step_without_a_plan_invalidates_its_sync_loads_blocks():
    """The scheduler side built no plan (its build_connector_meta raised) in a step with
    synchronous loads: the loads never ran, so the blocks they were to fill are invalid."""
    mc = ModelConfig(layer_types=("full",))
    cfg = make_kv_cache_config(mc, block_size=4)
    conn = _RecordingWorker(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    runner = ModelRunner(mc, cfg, connector=conn)
    so = SchedulerOutput(
        [NewRequestData("a", list(range(10)), ([5, 6, 7],), 8)],
        CachedRequestData.make_empty(),
        {"a": 2},
        2,
        set(),
        set(),
        None,
        has_sync_kv_loads=True,
    )
    out = runner.execute_model(so)
    assert out.kv_connector_output.invalid_block_ids == {5, 6}
    assert "bind_connector_metadata" not in conn.calls


class _ReceivesWithUnknownErrors(_RecordingWorker):
    def get_finished(self, finished_req_ids):
        self._rec("get_finished")
        return None, {"a"}


def test_receives_fail_when_the_connector_cannot_tell_its_load_errors():
    """get_block_ids_with_load_errors raised: which loads failed is unknown, so every
    receive the step reports is a failed one (recomputed, never trusted)."""
    mc = ModelConfig(layer_types=("full",))
    cfg = make_kv_cache_config(mc, block_size=4)
    conn = _ReceivesWithUnknownErrors(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    conn.raise_in = {"get_block_ids_with_load_errors"}
    runner = ModelRunner(mc, cfg, connector=conn)
    out = runner.execute_model(
        SchedulerOutput([], CachedRequestData.make_empty(), {}, 0, set(), set(), _Meta())
    )
    assert (
        out.kv_connector_output.finished_recving == {"a"} == out.kv_connector_output.failed_recving
    )


class _PreemptionRecorder(_RecordingWorker):
    def handle_preemptions(self, connector_metadata):
        self._rec("handle_preemptions")
        self.preemption_plan = connector_metadata


class _NoLayerHooks(_RecordingWorker):
    uses_layer_hooks = False


def test_handle_preemptions_gets_the_steps_plan_right_after_bind():
    mc = ModelConfig(layer_types=("full",))
    cfg = make_kv_cache_config(mc, block_size=4)
    conn = _PreemptionRecorder(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    runner = ModelRunner(mc, cfg, connector=conn)
    conn.calls.clear()
    plan = _Meta(step=3)
    so = SchedulerOutput(
        [NewRequestData("a", [1, 2, 3], ([1],), 0)],
        CachedRequestData.make_empty(),
        {"a": 3},
        3,
        set(),
        set(),
        plan,
    )
    runner.execute_model(so)
    assert conn.calls[:2] == ["bind_connector_metadata", "handle_preemptions"]
    assert conn.preemption_plan == plan


def test_a_connector_without_layer_hooks_gets_no_per_layer_calls():
    mc = ModelConfig(layer_types=("full", "full"))
    cfg = make_kv_cache_config(mc)
    conn = _NoLayerHooks(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    runner = ModelRunner(mc, cfg, connector=conn)
    conn.calls.clear()
    so = SchedulerOutput(
        [NewRequestData("a", [1, 2, 3], ([1],), 0)],
        CachedRequestData.make_empty(),
        {"a": 3},
        3,
        set(),
        set(),
        _Meta(),
    )
    out = runner.execute_model(so)
    assert conn.calls == ["bind_connector_metadata"] + ["start_load_kv"] + TAIL
    assert out.sampled_token_ids["a"]


def test_runner_rejects_inconsistent_plans():
    """Too few blocks, unknown cached requests and unknown tokens raise InvariantError."""
    mc = ModelConfig(layer_types=("full",))
    runner = ModelRunner(mc, make_kv_cache_config(mc, block_size=4))
    few_blocks = SchedulerOutput(
        [NewRequestData("a", list(range(10)), ([1, 2],), 0)],
        CachedRequestData.make_empty(),
        {"a": 10},
        10,
        set(),
        set(),
    )
    with pytest.raises(InvariantError, match="needs block #2"):
        runner.execute_model(few_blocks)
    unknown = SchedulerOutput(
        [], CachedRequestData(["zz"], set(), [[]], [None], [0]), {"zz": 1}, 1, set(), set()
    )
    with pytest.raises(InvariantError, match="never sent"):
        runner.execute_model(unknown)
    too_many = SchedulerOutput(
        [NewRequestData("b", [1, 2], ([3],), 0)],
        CachedRequestData.make_empty(),
        {"b": 3},
        3,
        set(),
        set(),
    )
    with pytest.raises(InvariantError, match="knows only 2 tokens"):
        runner.execute_model(too_many)


def test_null_block_in_visible_window_is_an_error():
    """A visible key mapped to the null block (0) is refused instead of read as garbage."""
    mc = ModelConfig(layer_types=("full",))
    runner = ModelRunner(mc, make_kv_cache_config(mc, block_size=4))
    so = SchedulerOutput(
        [NewRequestData("a", list(range(6)), ([0, 2],), 4)],
        CachedRequestData.make_empty(),
        {"a": 2},
        2,
        set(),
        set(),
    )
    with pytest.raises(InvariantError, match="null block"):
        runner.execute_model(so)


def test_resume_replaces_blocks_and_truncates_discarded_samples():
    """A resumed request's blocks replace the old ones; num_output_tokens drops discarded
    samples."""
    mc = ModelConfig(layer_types=("full",))
    runner = ModelRunner(mc, make_kv_cache_config(mc, block_size=4))
    prompt = list(range(1, 7))
    first = runner.execute_model(
        SchedulerOutput(
            [NewRequestData("a", prompt, ([1, 2],), 0)],
            CachedRequestData.make_empty(),
            {"a": 6},
            6,
            set(),
            set(),
        )
    )
    token = first.sampled_token_ids["a"][0]
    # The scheduler discarded that sample (e.g. failed load) and rolled back to 4 tokens,
    # then the request was preempted and resumed on other blocks: recompute everything.
    resumed = CachedRequestData(["a"], {"a"}, [[]], [([8, 9],)], [0], [0])
    again = runner.execute_model(SchedulerOutput([], resumed, {"a": 6}, 6, set(), set()))
    assert again.sampled_token_ids["a"] == [token]
    assert runner.requests["a"].block_ids == [[8, 9]]
    assert runner.requests["a"].token_ids == [*prompt, token]
    # Finished requests are dropped from the worker state.
    runner.execute_model(SchedulerOutput([], CachedRequestData.make_empty(), {}, 0, {"a"}, set()))
    assert "a" not in runner.requests


def test_harness_outputs_match_with_recording_connector():
    """A connector that moves nothing leaves outputs unchanged."""
    mc = ModelConfig(layer_types=("full", "full"))
    cfg = make_kv_cache_config(mc)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    conn = _RecordingWorker(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    plain = run_requests(prompts, 3, model_config=mc)
    with_conn = run_requests(prompts, 3, runner=ModelRunner(mc, cfg, connector=conn))
    assert plain == with_conn


def test_per_step_sync_flag_runs_start_load_before_the_forward():
    """SchedulerOutput.has_sync_kv_loads moves start_load_kv before the layers for that step
    only."""
    mc = ModelConfig(layer_types=("full",))
    cfg = make_kv_cache_config(mc)
    conn = _RecordingWorker(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    assert not conn.has_sync_kv_loads  # the class attribute says "async"
    runner = ModelRunner(mc, cfg, connector=conn)
    layers = _layer_calls(mc.layer_names())
    conn.calls.clear()
    so = SchedulerOutput(
        [NewRequestData("a", [1, 2, 3], ([1],), 0)],
        CachedRequestData.make_empty(),
        {"a": 3},
        3,
        set(),
        set(),
        _Meta(),
        has_sync_kv_loads=True,
    )
    runner.execute_model(so)
    assert conn.calls == ["bind_connector_metadata", "start_load_kv", *layers, *SYNC_TAIL]
    conn.calls.clear()
    so = SchedulerOutput(
        [], CachedRequestData(["a"], set(), [[]], [None], [3]), {"a": 1}, 1, set(), set(), _Meta()
    )
    runner.execute_model(so)
    assert conn.calls == ["bind_connector_metadata", *layers, "start_load_kv", *TAIL]


class _WorkerMetaWorker(_RecordingWorker):
    def get_kv_connector_kv_cache_events(self):
        self._rec("get_kv_connector_kv_cache_events")
        return None

    def build_connector_worker_meta(self):
        self._rec("build_connector_worker_meta")
        return {"saved": 1}


def test_build_connector_worker_meta_runs_after_events_before_clear():
    """The optional hook runs in the reference position; its result reaches the output."""
    mc = ModelConfig(layer_types=("full",))
    cfg = make_kv_cache_config(mc)
    conn = _WorkerMetaWorker(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    runner = ModelRunner(mc, cfg, connector=conn)
    empty = SchedulerOutput.make_empty()
    empty.kv_connector_metadata = _Meta()
    conn.calls.clear()
    out = runner.execute_model(empty)
    assert conn.calls[-3:] == [
        "get_kv_connector_kv_cache_events",
        "build_connector_worker_meta",
        "clear_connector_metadata",
    ]
    assert out.kv_connector_output.kv_connector_worker_meta == {"saved": 1}
    conn.raise_in = {"build_connector_worker_meta"}
    out = runner.execute_model(empty)
    assert out.kv_connector_output.kv_connector_worker_meta is None
    assert runner.connector_errors == {"build_connector_worker_meta": 1}


def test_failed_sync_load_spares_shared_prefix_blocks_and_freed_blocks():
    """Only blocks a sync load could target are invalid: not blocks another live request holds."""
    mc = ModelConfig(layer_types=("full",))
    cfg = make_kv_cache_config(mc, block_size=4)
    conn = _RecordingWorker(KVConnectorConfig(name="x"), KVConnectorRole.WORKER, cfg)
    runner = ModelRunner(mc, cfg, connector=conn)
    prefix = list(range(1, 9))
    # "a" computes the shared prefix into blocks 1, 2; "p" runs and is then preempted.
    runner.execute_model(
        SchedulerOutput(
            [
                NewRequestData("a", [*prefix, 50], ([1, 2, 3],), 0),
                NewRequestData("p", [40, 41, 42], ([9],), 0),
            ],
            CachedRequestData.make_empty(),
            {"a": 9, "p": 3},
            12,
            set(),
            set(),
            _Meta(),
        )
    )
    runner.execute_model(
        SchedulerOutput(
            [],
            CachedRequestData(["a"], set(), [[]], [None], [9]),
            {"a": 1},
            1,
            set(),
            {"p"},
            _Meta(),
        )
    )
    # "b" hits the prefix locally (blocks 1, 2) and loads 8 tokens into blocks 5, 9 (9 was
    # p's, freed by the preemption); the load fails.
    conn.raise_in = {"start_load_kv"}
    so = SchedulerOutput(
        [NewRequestData("b", [*prefix, *range(20, 30)], ([1, 2, 5, 9, 6],), 16)],
        CachedRequestData.make_empty(),
        {"b": 2},
        2,
        set(),
        set(),
        _Meta(),
        has_sync_kv_loads=True,
    )
    out = runner.execute_model(so)
    assert out.kv_connector_output.invalid_block_ids == {5, 9}
    assert out.kv_connector_output.loads_failed
    # Without sync loads in the step, a failed load hook invalidates nothing the batch read.
    so = SchedulerOutput(
        [NewRequestData("c", [*prefix, 60, 61], ([1, 2, 7],), 8)],
        CachedRequestData.make_empty(),
        {"c": 2},
        2,
        set(),
        set(),
        _Meta(),
    )
    out = runner.execute_model(so)
    assert (
        out.kv_connector_output.invalid_block_ids == set() and out.kv_connector_output.loads_failed
    )

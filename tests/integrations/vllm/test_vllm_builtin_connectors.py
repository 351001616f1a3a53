"""vLLM 0.33's own connectors in the rig (issue 21, item 5): which run on a CPU, and what
the byte oracle finds.

- ``ExampleConnector`` (vLLM's reference "shared storage" connector) runs: its loads are
  byte-exact, but only while no prompt is split over steps. Under chunked prefill it saves
  a request's KV only in the request's first step (the first chunk), in a folder named by
  the whole block-aligned prompt; a later request with that prompt is told the whole
  prompt hits, and its load raises (a shape mismatch) inside vLLM's worker. The connector
  is wrong, not the rig: the reproducer is ``test_example_connector_under_chunked_prefill``.
- ``OffloadingConnector`` refuses a CPU platform when it is built ("CPU Offloading is
  currently only supported on CUDA-alike and XPU GPUs").
- ``SimpleCPUOffloadConnector`` needs CUDA streams (``torch.Stream.priority_range``).
- The others need hardware or services a CPU machine lacks (NIXL, Mooncake, NCCL, LMCache,
  FlexKV, 3FS, MoRI-IO), or move no KV (``ExampleHiddenStatesConnector``,
  ``DecodeBenchConnector``, which fills KV with random values on purpose).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from kvconnector_core.testing.vllm import VllmRig, prompt


def _example(tmp_path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}


def _store_then_load(rig: VllmRig, tokens: list[int]):
    rig.add(tokens, max_tokens=2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    rig.wipe()  # only the connector can bring the prompt's bytes back
    rig.add(tokens + [5], max_tokens=2)
    return rig.check()


def test_example_connector_loads_byte_exact(tmp_path):
    rig = VllmRig.from_kv_transfer_config(_example(tmp_path), num_gpu_blocks=24,
                                          max_num_batched_tokens=256, raise_on_wrong=False)
    report = _store_then_load(rig, prompt(1, 100))
    assert report.ok, report.format()
    assert report.hit_tokens == 96 and report.loaded_layer_blocks_checked == 6 * 4


def test_example_connector_under_chunked_prefill(tmp_path):
    """The prompt's 100 tokens take two steps of 64: only the first 64 tokens' KV is saved,
    96 are claimed, and the load raises in the worker."""
    rig = VllmRig.from_kv_transfer_config(_example(tmp_path), num_gpu_blocks=24,
                                          max_num_batched_tokens=64, raise_on_wrong=False)
    report = _store_then_load(rig, prompt(1, 100))
    assert report.hit_tokens == 96
    assert [e.split(":")[0] for e in report.exceptions] == ["RuntimeError"]
    assert "shape mismatch" in report.exceptions[0]


@pytest.mark.parametrize(("name", "error"), [
    ("OffloadingConnector", "only supported on CUDA-alike and XPU GPUs"),
    ("SimpleCPUOffloadConnector", "priority_range")])
def test_vllms_offloading_connectors_need_a_gpu(name, error):
    config = {"kv_connector": name, "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 4_000_000}}
    with pytest.raises(Exception, match=error):
        VllmRig.from_kv_transfer_config(config)


def test_a_connector_reading_the_tp_group_when_built_runs(tmp_path):
    """Third-party connectors (LMCache, sparkcache) read ``get_tp_group()`` while vLLM
    builds them; vLLM's worker has set its process groups up by then, and so does the rig
    (one rank: its workers share a process)."""
    config = {**_example(tmp_path), "kv_connector": "TPGroupConnector",
              "kv_connector_module_path": "_tp_group_connector"}
    rig = VllmRig.from_kv_transfer_config(config, num_gpu_blocks=24,
                                          max_num_batched_tokens=256, raise_on_wrong=False)
    assert [w.tp_rank for w in rig.workers] == [0]
    report = _store_then_load(rig, prompt(1, 100))
    assert report.ok, report.format()
    assert report.hit_tokens == 96

"""MultiConnector with the CPU offload connector inside, end to end through the Engine and the CLI.

The offload child must complete its stores and serve loads from the CPU tier exactly as it
does alone: its job completions travel as its own worker metadata, not in the (nested) stats.
"""

from __future__ import annotations

import json
import random

import pytest

from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest

OFFLOAD = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64, "blocks_per_chunk": 2}}
TTL = {"name": "ttl", "extra_config": {"ttl_seconds": 1000, "max_pinned_blocks": 4}}


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # `kvconnector run` sets one thread on CPU


def doc_trace(seed: int = 0, rounds: int = 3) -> list[TraceRequest]:
    """Four 96-token documents asked about repeatedly; the GPU pool cannot keep them all."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000) for _ in range(96)] for _ in range(4)]
    return [
        TraceRequest(request_id=f"r{r}-{d}", arrival=r * 40 + d * 2, max_new_tokens=8,
                     prompt_token_ids=doc + [rng.randrange(1000) for _ in range(5)])
        for r in range(rounds) for d, doc in enumerate(docs)
    ]


def engine(connector: dict | None, **overrides: int) -> Engine:
    cfg = {"num_gpu_blocks": 24, "block_size": 16, "max_model_len": 256,
           "max_num_batched_tokens": 128, "max_num_seqs": 2, **overrides}
    return Engine(EngineConfig(connector=connector, **cfg))


def multi(*children: dict) -> dict:
    return {"name": "MultiConnector", "extra_config": {"connectors": list(children)}}


@pytest.mark.parametrize("children", [(TTL, OFFLOAD), (OFFLOAD,)], ids=["ttl+offload", "offload"])
def test_offload_inside_multi_serves_from_cpu_with_identical_outputs(
    children: tuple[dict, ...],
) -> None:
    trace = doc_trace()
    baseline = engine(None).run(trace)
    eng = engine(multi(*children))
    result = eng.run(trace)
    assert result.outputs == baseline.outputs
    m = result.metrics
    assert m.connector_hit_tokens > 0 and m.bytes_loaded > 0 and m.bytes_stored > 0
    assert m.connector_errors == {}
    offload = eng.scheduler_connector.children[-1]
    # Every store completed (nothing stuck "being written"), no job or request left behind.
    assert all(entry.ref_cnt == 0 for _, entry in offload.manager.policy)
    assert len(offload.manager.policy) > 0
    assert not offload.scheduler_side.state.jobs and not offload.scheduler_side.state.reqs
    eng.shutdown()


def test_offload_inside_multi_under_preemption_matches_baseline() -> None:
    """Preempted requests' stores are flushed through the multi (handle_preemptions is
    forwarded)."""
    for seed in range(3):
        rng = random.Random(seed)
        shared = [rng.randrange(1000) for _ in range(48)]
        trace = [
            TraceRequest(
                request_id=f"q{i}",
                arrival=(i // 4) * 30,
                max_new_tokens=40,
                prompt_token_ids=shared + [rng.randrange(1000) for _ in range(22)],
            )
            for i in range(8)
        ]
        small = {
            "num_gpu_blocks": 14,
            "max_model_len": 128,
            "max_num_batched_tokens": 64,
            "max_num_seqs": 4,
        }
        baseline = engine(None, **small).run(trace)
        eng = engine(
            multi({"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64}}), **small
        )
        result = eng.run(trace)
        assert result.metrics.num_preemptions > 0
        assert result.outputs == baseline.outputs, f"seed {seed}"
        offload = eng.scheduler_connector.children[0]
        assert all(entry.ref_cnt == 0 for _, entry in offload.manager.policy)
        eng.shutdown()


def test_cli_run_with_multi_config_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvconnector run --config FILE` with MultiConnector[ttl, cpu_offload]: hits, same outputs."""
    pytest.importorskip(
        "kvconnector_core.cli.run_cmd", reason="needs the engine's `kvconnector run` command"
    )
    from kvconnector_core.cli import main

    path = tmp_path / "multi.json"
    path.write_text(
        json.dumps(
            multi({"name": "ttl"}, {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 256}})
        )
    )
    assert main(["run", "--workload", "documents", "--config", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["comparison"]["identical"] is True
    assert report["metrics"]["connector_hit_tokens"] > 0

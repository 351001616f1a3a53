"""The integer paged-attention model: outputs independent of batching, chunking and block
placement; any corrupted KV block changes the output."""

from __future__ import annotations

import random

import pytest
import torch
from _runner_harness import make_kv_cache_config, run_requests
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnector_core.errors import ConfigError
from kvconnector_core.worker.model import PRIME, ModelConfig
from kvconnector_core.worker.model_runner import ModelRunner

HYBRID = ModelConfig(layer_types=("full", "sliding", "full", "sliding"), sliding_window=7)
MODELS = [pytest.param(ModelConfig(), id="full"), pytest.param(HYBRID, id="hybrid")]


def _prompts(seed: int, n: int = 5, lo: int = 3, hi: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("model_config", MODELS)
@pytest.mark.parametrize("chunk", [1, 5, 16, 1000], ids=lambda c: f"chunk{c}")
def test_outputs_identical_under_chunking_and_block_placement(model_config, chunk):
    """Chunk size and which physical blocks a request gets never change its tokens."""
    prompts = _prompts(1)
    reference = run_requests(prompts, 6, model_config=model_config, chunk=1000, block_seed=0)
    got = run_requests(prompts, 6, model_config=model_config, chunk=chunk, block_seed=chunk)
    assert got == reference


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000), chunk=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 8])
)
def test_batch_composition_does_not_matter(seed, chunk, block_size):
    """A request generates the same tokens alone or batched with others, for any block size."""
    prompts = _prompts(seed, n=3, hi=30)
    together = run_requests(
        prompts, 4, model_config=HYBRID, chunk=chunk, block_size=block_size, block_seed=seed
    )
    alone = run_requests(prompts[1:2], 4, model_config=HYBRID, chunk=1000, block_size=block_size)
    assert together["r1"] == alone["r0"]


def test_different_prompts_and_seeds_give_different_outputs():
    """The model is not degenerate: outputs depend on the prompt and on the weight seed."""
    prompts = _prompts(2, n=4)
    a = run_requests(prompts, 8)
    assert len({tuple(v) for v in a.values()}) == 4
    b = run_requests(prompts, 8, model_config=ModelConfig(seed=1))
    assert a != b


@pytest.mark.parametrize("model_config", MODELS)
@pytest.mark.parametrize("mode", ["corrupt_one_value", "zero_block", "swap_blocks"])
def test_corrupted_kv_block_changes_output(model_config, mode):
    """Any wrong, stale or misplaced KV block visible to a request changes its tokens."""
    prompts = [list(range(1, 25))]
    clean = run_requests(prompts, 6, model_config=model_config)

    def corrupt(step, runner, reqs):
        if step != 1:  # after the prefill, before the first decode step
            return
        blocks = reqs["r0"].block_ids[-1]  # last group: a sliding group for the hybrid model
        # 24 prompt tokens in blocks of 4: blocks[-2] holds positions 16-19, blocks[-3]
        # 12-15; the next token (position 24) sees 18-24 through a 7-token window.
        victim, other = blocks[-2], blocks[-3]
        for name, (g, _) in runner.kv_caches.layer_to_group.items():
            if g != len(reqs["r0"].block_ids) - 1:
                continue
            kv = runner.kv_caches.layer_tensors[name]
            if mode == "corrupt_one_value":
                # Last slot of the block: position 19, inside the window of position 24.
                kv[victim, 1, -1, 0, 0] = (kv[victim, 1, -1, 0, 0] + 1) % PRIME
                break
            if mode == "zero_block":
                kv[victim] = 0
            else:
                kv[[victim, other]] = kv[[other, victim]].clone()

    assert run_requests(prompts, 6, model_config=model_config, before_step=corrupt) != clean


def test_model_config_validation():
    """Bad model shapes raise ConfigError naming the field and the valid choices."""
    with pytest.raises(ConfigError, match="layer types"):
        ModelConfig(layer_types=("full", "dense"))
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig(layer_types=("sliding",))
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig(vocab_size=0)


def test_kv_cache_config_must_match_model_windows():
    """A KV cache config built for another window is refused."""
    cfg = make_kv_cache_config(ModelConfig(layer_types=("full", "sliding"), sliding_window=5))
    with pytest.raises(ConfigError, match="window"):
        ModelRunner(ModelConfig(layer_types=("full", "sliding"), sliding_window=6), cfg)


def test_kv_values_are_residues_in_int32():
    """The cache stores int32 residues mod PRIME."""
    runner = ModelRunner(ModelConfig(), make_kv_cache_config(ModelConfig()))
    run_requests(_prompts(3, n=2), 2, runner=runner)
    t = runner.kv_caches.group_tensors[0]
    assert t.dtype == torch.int32
    assert int(t.min()) >= 0 and int(t.max()) < PRIME and int(t.count_nonzero()) > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    """Exact integer maths gives the same tokens on CUDA as on CPU."""
    prompts = _prompts(4)
    cpu = run_requests(prompts, 5, model_config=HYBRID, chunk=7)
    runner = ModelRunner(HYBRID, make_kv_cache_config(HYBRID), device="cuda")
    assert run_requests(prompts, 5, runner=runner, chunk=13) == cpu

"""Model presets, model-config files, new layer kinds (per-layer windows, chunked local),
2-byte KV, and ``kvconnector run --model``."""

from __future__ import annotations

import json

import pytest
import torch

from kvconnector_core.cli import main
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.models import MODEL_PRESETS, get_model, load_model_config
from kvconnector_core.engine.workloads import multi_turn_chat
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
    kv_cache_bytes_per_block,
)
from kvconnector_core.worker.model import ModelConfig


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # run_cmd sets one thread on CPU


def test_llama_3_8b_preset_has_the_real_kv_shape():
    """32 layers x 8 KV heads x 128 x 2 bytes x K,V x 16 tokens = 2 MiB per block."""
    m = get_model("llama-3-8b")
    specs = m.kv_cache_specs(16)
    assert len(specs) == 32 and len(set(specs.values())) == 1
    assert kv_cache_bytes_per_block(specs) == 2 * 2**20
    assert "32 layers (32 full), 8 KV heads x 128, int16 KV: 2.00 MiB" in m.describe(16)


def test_gpt_oss_presets_are_full_plus_sliding_hybrids():
    m = get_model("GPT-OSS-20B")
    kinds = m.layer_attention()
    assert kinds[:2] == [("sliding", 128), ("full", 0)] and len(kinds) == 24
    specs = set(m.kv_cache_specs(16).values())
    assert len(specs) == 2 and any(isinstance(s, SlidingWindowSpec) for s in specs)
    # Equal page sizes: one physical pool of 12 layer slots, not 24.
    page = next(iter(specs)).page_size_bytes
    assert kv_cache_bytes_per_block(m.kv_cache_specs(16)) == 12 * page


def test_every_preset_builds_its_specs():
    for name, model in MODEL_PRESETS.items():
        assert model.kv_cache_specs(16), name


def test_layer_types_with_sizes_and_chunks():
    m = ModelConfig(layer_types=("sliding:8", "sliding:32", "chunked:64", "full"))
    specs = list(m.kv_cache_specs(4).values())
    assert [s.sliding_window for s in specs[:2]] == [8, 32]
    assert isinstance(specs[2], ChunkedLocalAttentionSpec) and specs[2].attention_chunk_size == 64
    with pytest.raises(ConfigError, match="'chunked'.*needs a size >= 1"):
        ModelConfig(layer_types=("chunked",))
    with pytest.raises(ConfigError, match="'full:3'.*valid layer types"):
        ModelConfig(layer_types=("full:3",))
    with pytest.raises(ConfigError, match="kv_dtype='float32'; valid: int32, int16"):
        ModelConfig(kv_dtype="float32")


def test_model_config_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"layer_types": ["full", "sliding:16"], "head_size": 8,
                                "kv_dtype": "int16"}))
    m = load_model_config(path)
    assert m.layer_types == ("full", "sliding:16") and m.head_size == 8
    assert get_model(str(path)) == m
    path.write_text(json.dumps({"layers": 3}))
    with pytest.raises(ConfigError, match="unknown field 'layers'; valid fields: .*layer_types"):
        load_model_config(path)
    with pytest.raises(ConfigError, match="unknown model 'nope'.*presets: tiny"):
        get_model("nope")


def _outputs(model: ModelConfig, **kw) -> dict[str, list[int]]:
    trace = multi_turn_chat(0, num_users=3, turns=3, system_prompt_len=80, user_turn_len=24,
                            max_new_tokens=6, vocab=1000)
    cfg = EngineConfig(model=model, max_num_batched_tokens=48, max_model_len=512, **kw)
    with Engine(cfg) as eng:
        return eng.run(trace).outputs


@pytest.mark.parametrize("layer_types", [("full", "chunked:32"), ("sliding:20", "sliding:56")])
def test_new_layer_kinds_give_the_same_outputs_with_prefix_caching(layer_types):
    """Chunked-local and per-layer windows free and reuse blocks, yet generate exactly
    what a run without prefix caching (and a roomy pool) generates."""
    m = ModelConfig(layer_types=layer_types, vocab_size=1000)
    assert (_outputs(m, num_gpu_blocks=80)
            == _outputs(m, num_gpu_blocks=400, enable_prefix_caching=False))


def test_chunked_attention_differs_from_full():
    """The chunk mask is applied: a chunked model generates other tokens than a full one."""
    full = _outputs(ModelConfig(layer_types=("full", "full"), vocab_size=1000), num_gpu_blocks=200)
    chunked = _outputs(ModelConfig(layer_types=("full", "chunked:32"), vocab_size=1000),
                       num_gpu_blocks=200)
    assert full != chunked


def test_int16_kv_generates_what_int32_kv_generates():
    a = _outputs(ModelConfig(vocab_size=1000), num_gpu_blocks=200)
    b = _outputs(ModelConfig(vocab_size=1000, kv_dtype="int16"), num_gpu_blocks=200)
    assert a == b


def test_cli_run_with_a_preset_reports_the_model_shape(capsys):
    assert main(["run", "--workload", "documents", "--model", "tiny-hybrid", "--json",
                 "--num-gpu-blocks", "96", "--connector", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"].startswith("4 layers (2 full, 2 sliding 64), 2 KV heads x 16")


def test_cli_run_unknown_model_lists_presets(capsys):
    assert main(["run", "--model", "gpt-5", "--connector", "none"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err

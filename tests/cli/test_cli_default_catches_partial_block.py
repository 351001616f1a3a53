"""``kvconnector run --connector NAME``, with no other argument, catches a connector that
skips the block a hit ends in part-way: the default workload has full-prompt hits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _reference_connector import ReferenceConnector

from kvconnector_core.cli import main
from kvconnector_core.plugins.registry import get_registry, reset_registry
from kvconnector_core.engine.workloads import get_workload


class SkipsPartialBlock(ReferenceConnector):
    """The reference connector with its ``partial_last_block`` bug planted by default."""

    name = "skips_partial_block"

    @classmethod
    def demo_extra_config(cls, num_gpu_blocks: int) -> dict[str, Any]:
        return {"bug": "partial_last_block"}


@pytest.fixture
def registered():
    before = torch.get_num_threads()
    reset_registry()
    get_registry().add(SkipsPartialBlock)
    yield
    reset_registry()
    torch.set_num_threads(before)  # run_cmd sets one thread on CPU


def test_default_run_fails_a_connector_that_skips_the_partial_block(registered, capsys):
    """Exit 1 and "outputs identical to baseline: NO" from the default run alone."""
    assert main(["run", "--connector", SkipsPartialBlock.name]) == 1
    out = capsys.readouterr().out
    assert "outputs identical to baseline: NO" in out
    assert "'rep-p" in out  # a repeated prompt is the first to differ


def test_default_workload_has_block_aligned_full_prompt_repeats():
    """The default workload sends block-aligned prompts (16-token blocks) again unchanged."""
    requests = get_workload("mixed").requests
    prompts = [tuple(r.prompt_token_ids) for r in requests
               if (r.request_id or "").startswith("rep-")]
    assert len(prompts) > len(set(prompts))
    assert any(len(p) % 16 == 0 for p in prompts) and any(len(p) % 16 for p in prompts)

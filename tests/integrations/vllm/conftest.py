"""The vLLM suite: runs only where vLLM 0.33 is installed (``make test-vllm``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Warnings raised inside third-party code that vLLM imports (torch's deprecations
# hit by vLLM's module-level torch.compile) are not ours to fix; warnings from
# kvconnector's code stay errors. (requests' RequestsDependencyWarning cannot occur:
# requirements/vllm-0.33-cpu.txt pins charset-normalizer.)
WARNINGS = (
    "ignore::DeprecationWarning:torch",
    "ignore::DeprecationWarning:vllm",
    "ignore::FutureWarning:torch",
    "ignore::FutureWarning:vllm",
    "ignore::UserWarning:torch",
    "ignore::UserWarning:vllm",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in WARNINGS:
        config.addinivalue_line("filterwarnings", line)


sys.path.insert(0, str(Path(__file__).parent))  # for _harness

"""The code block of docs/vllm.md runs under vLLM 0.33: vLLM's own Scheduler, constructed
with a kvconnector connector behind the adapter, from a model config file alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"


def _block(name: str) -> str:
    text = DOC.read_text()
    match = re.search(rf"^<!-- docs-test: {name} -->\n```python\n(.*?)^```", text, re.M | re.S)
    assert match is not None, f"no docs-test block {name!r} in {DOC}"
    return match[1]


def test_vllm_scheduler_block_builds_vllms_scheduler_with_a_kvconnector_connector(capsys):
    namespace: dict[str, object] = {}
    exec(  # noqa: S102
        compile(_block("vllm-scheduler"), f"{DOC}:vllm-scheduler", "exec", dont_inherit=True),
        namespace,
    )
    adapter = namespace["adapter"]
    assert type(adapter).__name__ == "KVConnectorAdapter"
    assert adapter.connector.name == "OffloadingConnector"
    assert "KVConnectorAdapter wraps OffloadingConnector" in capsys.readouterr().out
    namespace["scheduler"].shutdown()
